"""The replica's side of residency routing: publish what the RAM tier holds (kv/residency.py).

Runs in the replica's first worker process, where the RAM tier is filled (the connector starts it
once the paged caches are registered; vLLM's CPU backend runs the worker apart from the
scheduler, whose store holds no blobs), on a daemon thread: every `INTERVAL_S` it compares the store's RAM tier with what it last published and
rewrites the summary when they differ, and at least every third of the summary's TTL so that a
live replica's summary never lapses. A Redis outage only delays the summary (logged once per
outage): routing falls back to rendezvous where a summary is missing, so nothing fails.
"""

from __future__ import annotations

import logging
import threading

import redis
from redis.exceptions import RedisError

from kvmem.kv import residency
from kvmem.kv.shared import CONNECT_TIMEOUT_S, safe_url
from kvmem.kv.store import KVStore

log = logging.getLogger("kvmem.kv")

INTERVAL_S = 0.25  # how stale a summary may be after the RAM tier changes


class ResidencyPublisher:
    def __init__(self, store: KVStore, redis_url: str, replica: str, interval_s: float = INTERVAL_S) -> None:
        self.store = store
        self.replica = replica.rstrip("/")
        self.published = 0  # summaries written (for tests and logs)
        self._where = safe_url(redis_url)
        self._client = redis.Redis.from_url(redis_url, socket_timeout=CONNECT_TIMEOUT_S,
                                            socket_connect_timeout=CONNECT_TIMEOUT_S,
                                            client_name="kvmem-residency")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(interval_s,), name="kvmem-residency", daemon=True)
        self._thread.start()

    def _loop(self, interval_s: float) -> None:
        last: dict[str, int] | None = None
        since = 0.0  # seconds since the last write
        failing = False
        while not self._stop.wait(interval_s):
            since += interval_s
            now = self.store.resident()
            if now == last and since < residency.TTL_S / 3:
                continue
            try:
                residency.publish(self._client, self.store.fingerprint, self.replica, now)
            except (RedisError, OSError) as e:
                if not failing:
                    log.warning("residency summary for %s not published to %s (%s): gateways route by "
                                "rendezvous until it is", self.replica, self._where, e)
                failing = True
                continue
            if failing:
                log.info("residency summary for %s published again", self.replica)
            last, since, failing = now, 0.0, False
            self.published += 1

    def close(self) -> None:
        """Stop and withdraw the summary (a replica that leaves attracts nothing more)."""
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            residency.publish(self._client, self.store.fingerprint, self.replica, {})
        except (RedisError, OSError):
            pass  # it lapses by its TTL
        self._client.close()
