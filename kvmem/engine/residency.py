"""Residency routing for a gateway (`engine.routing = "residency"`): the replicas' RAM-tier
summaries in Redis (kv/residency.py), read per request, turned into an order by routing.py.

For each KV-mode request `RemoteEngine` asks `ResidencyView.order` with the user's rendezvous
order and the request's facts (fact id -> blob bytes, from its plan). One pipelined Redis round
trip reads which of those facts each live replica holds; speculative entries (routing.ResidencyIndex)
stand for pulls this gateway just caused and that no summary shows yet; the load is the larger of
the replica's own queue (vLLM's running + waiting gauges, scraped by the health probe) and this
gateway's requests in flight there. The policy puts the replica with the least expected extra
delay first and keeps rendezvous order on ties, so a cold cluster, a text-mode chat or an encode
routes exactly as rendezvous does.

Redis unreachable: rendezvous order (and a warning once per outage). The chosen replica pulls what
it lacks when the request arrives, as any replica does; nothing is fetched ahead of it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

import redis
from redis.exceptions import RedisError

from kvmem.engine.routing import Load, ResidencyIndex, Resident, Weights, residency_order
from kvmem.kv import residency
from kvmem.kv.shared import safe_url

log = logging.getLogger(__name__)

# This host's costs (kvmem/bench/cluster_sim.py COSTS, from docs/results/tier-costs.json,
# ttft-fidelity-fast.json and load.json): a MiB pulled from Redis rather than read from RAM
# ~3.8 ms, from local disk ~0.3 ms; a chat queued beyond a replica's slots waits ~0.35 s (a
# k=10, 32-token chat's service time over 4 slots).
WEIGHTS = Weights(pull_s_per_mib=0.0038, disk_s_per_mib=0.0003, queue_s=0.35)
SLOTS = 4  # chats a replica serves at once without one waiting on another (load.json, this host)
READ_TIMEOUT_S = 0.2  # a slow Redis must not stall routing: rendezvous instead
RETRY_AFTER_S = 2.0  # after a failed read, rendezvous without asking for this long


class ResidencyView:
    def __init__(self, redis_url: str, fingerprint: str, weights: Weights = WEIGHTS, slots: int = SLOTS,
                 speculative_ttl_s: float = 2.0) -> None:
        self.fingerprint = fingerprint
        self.weights = weights
        self.slots = slots
        self.moved = 0  # requests sent to a replica other than the user's rendezvous choice
        self._where = safe_url(redis_url)
        self._client = redis.Redis.from_url(redis_url, socket_timeout=READ_TIMEOUT_S,
                                            socket_connect_timeout=READ_TIMEOUT_S, client_name="kvmem-routing")
        self._index = ResidencyIndex(speculative_ttl_s)
        self._inflight: Counter[str] = Counter()  # replica -> this gateway's requests there now
        self._queued: dict[str, int] = {}  # replica -> running + waiting, from its metrics
        self._lock = threading.Lock()
        self._down_until = 0.0

    def order(self, ranked: list[str], facts: dict[str, int]) -> list[str]:
        """`ranked` (the user's rendezvous order of live replicas) reordered for a request needing
        `facts` (fact id -> bytes): least expected delay first."""
        if len(ranked) < 2 or not facts:
            return ranked
        reported = self._read(ranked, list(facts))
        now = time.monotonic()
        with self._lock:
            held = {url: set(found) for url, found in reported.items()}
            for fact in facts:
                for url in self._index.assumed(fact, now):
                    held.setdefault(url, set()).add(fact)
            resident = {url: Resident(ram=sum(facts[f] for f in held_facts)) for url, held_facts in held.items()}
            load = {url: Load(max(self._queued.get(url, 0), self._inflight[url]), self.slots) for url in ranked}
            order = residency_order(ranked, sum(facts.values()), resident, load, self.weights)
            self._index.speculate(order[0], facts, now)
        self.moved += order[0] != ranked[0]
        return order

    def _read(self, ranked: list[str], facts: list[str]) -> dict[str, dict[str, int]]:
        if time.monotonic() < self._down_until:
            return {}
        try:
            return residency.read(self._client, self.fingerprint, ranked, facts)
        except (RedisError, OSError) as e:
            log.warning("residency summaries unreadable at %s (%s): rendezvous for %.0f s", self._where, e,
                        RETRY_AFTER_S)
            self._down_until = time.monotonic() + RETRY_AFTER_S
            return {}

    def sent(self, url: str) -> None:
        with self._lock:
            self._inflight[url] += 1

    def done(self, url: str) -> None:
        with self._lock:
            self._inflight[url] -= 1

    def queued(self, url: str, n: int) -> None:
        """The replica's own count of running plus waiting requests (the health probe's scrape)."""
        with self._lock:
            self._queued[url] = n

    def forget(self, url: str) -> None:
        """A replica left the set: its speculative entries go."""
        with self._lock:
            self._index.drop(url)
            self._queued.pop(url, None)

    def close(self) -> None:
        self._client.close()

