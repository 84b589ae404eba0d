"""`kvmem bench cluster`: many replicas, simulated, routed by the real router (issue 54, item 4).

A discrete-event simulation in one process, no engine: a synthetic trace (users drawn by Zipf,
each with their own facts, k facts per chat drawn by Zipf among the user's, Poisson arrivals) is
routed by kvmem/engine/routing.py (rendezvous, or residency scoring over a ResidencyIndex fed by
the simulated replicas' tier changes after a publication lag, with speculative entries), and
each replica is simulated by measured costs (COSTS below, each with the figure it comes from):
a bounded batch of `slots` chats at once, FCFS behind it; a chat's TTFT is its wait plus the
k=0 TTFT plus, per fact, the injection cost and the read cost of the tier the fact is found in
(RAM tier, local disk tier, or pulled from the shared Redis tier into both); it then holds its
slot for the decode. A replica's RAM tier is an LRU of `ram_mib`; its disk tier keeps every blob
it pulled. Membership: at `change_at` of the timed window a share of replicas dies at once (what
they were serving is sent again, except chats past their first token: cut, as a stream that
fails after its first byte is not retried; their tiers are gone and the router drops them),
and/or new, empty replicas join.

What it leaves out (docs/deploy.md "The 100-replica picture"): vLLM's own prefix cache, batching
effects on a chat's speed, network transfer beyond loopback, a replica's pulls in parallel, the
gateway's hop and retrieval, and metric scrape lag (the router sees queue depths exactly).
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, field, replace
from itertools import accumulate

from kvmem.bench.report import percentile
from kvmem.engine.remote import rendezvous
from kvmem.engine.routing import DISK, MIB, RAM, Load, ResidencyIndex, Weights, residency_order
from kvmem.errors import InvalidInputError

POLICIES = ("rendezvous", "residency")


@dataclass(frozen=True)
class Costs:
    """Seconds per chat, fact or token on one replica, and the blob size; `SOURCES` cites each."""

    base_s: float  # KV-mode TTFT at k=0: system prefix + question prefilled, 1 token
    inject_s: float  # per fact injected from the replica's own tiers
    ram_s: float  # per blob read from the RAM tier
    disk_s: float  # per blob read from the local disk tier
    pull_s: float  # per blob pulled from Redis (GET, local write, read)
    decode_s: float  # per output token after the first
    slots: int  # chats a replica serves at once
    fact_bytes: int  # one fact's blob

    def fact_s(self, tier: str | None) -> float:
        """One fact's share of the TTFT, found in `tier` (None: pulled). The injection slope was
        measured with blobs read from RAM or disk, so only the tier's read beyond RAM is added."""
        read = {RAM: self.ram_s, DISK: self.disk_s, None: self.pull_s}[tier]
        return self.inject_s + read - self.ram_s

    def weights(self, k: int, max_tokens: int) -> Weights:
        """The router's weights from the same costs: a MiB pulled or read from disk, and a chat's
        service time over the slots for each chat queued ahead."""
        mib = self.fact_bytes / MIB
        service = self.base_s + k * self.inject_s + (max_tokens - 1) * self.decode_s
        return Weights(pull_s_per_mib=(self.pull_s - self.ram_s) / mib,
                       disk_s_per_mib=(self.disk_s - self.ram_s) / mib, queue_s=service / self.slots)


# This CPU host (vLLM's CPU backend, SmolLM2-135M, 2 cores), from results in docs/results/:
COSTS = Costs(
    base_s=0.1264,  # ttft-fidelity-fast.json (2026-12-06), k=0 row: kv median 0.1264 s
    inject_s=0.002109,  # same file: (kv median at k=50 0.2318 s - at k=0 0.1264 s) / 50 facts
    ram_s=0.00000746,  # tier-costs.json (scripts/tier_costs.py, 0.46 MB blobs): ram median
    disk_s=0.0001332,  # tier-costs.json: disk median
    pull_s=0.001669,  # tier-costs.json: pull median (Redis on loopback; mean 1.80 ms, p90 2.24 ms)
    decode_s=0.03986,  # load.json (2026-11-29), 1 user, kv: (2.793 s / 4 chats - TTFT p50 0.1003 s) / 15 tokens
    slots=4,  # load.json, kv: 6.35 chats/s at 16 users over 1.43 at 1 user = 4.43, floored
    fact_bytes=460_800,  # tier-costs.json blob_bytes: 20 tokens, as ttft-fidelity-fast.json's (1075 - 56) / 50
)
SOURCES = {
    "base_s": "docs/results/ttft-fidelity-fast.json rows[k=0].kv.median",
    "inject_s": "docs/results/ttft-fidelity-fast.json (rows[k=50].kv.median - rows[k=0].kv.median) / 50",
    "ram_s": "docs/results/tier-costs.json seconds.ram.median",
    "disk_s": "docs/results/tier-costs.json seconds.disk.median",
    "pull_s": "docs/results/tier-costs.json seconds.pull.median",
    "decode_s": "docs/results/load.json rows[users=1].kv: (wall_s / requests - ttft_p50) / (max_tokens - 1)",
    "slots": "docs/results/load.json rows[users=16].kv.requests_per_s / rows[users=1].kv.requests_per_s, floored",
    "fact_bytes": "docs/results/tier-costs.json blob_bytes",
}


@dataclass(frozen=True)
class Scenario:
    replicas: int = 10
    users_per_replica: int = 50
    facts_per_user: int = 100
    k: int = 50
    user_zipf: float = 1.0  # skew over users (1.0: bench cache's)
    fact_zipf: float = 1.0  # skew over each user's facts
    rate_per_replica: float = 2.5  # chats per second, Poisson
    seconds: float = 90.0  # simulated arrivals
    warmup_s: float = 30.0  # arrivals before this are not timed
    max_tokens: int = 16
    ram_mib: int = 512  # a replica's RAM tier (KVMEM_HOT_CACHE_MIB's default)
    publish_s: float = 0.5  # a replica's tier change reaches the router after this
    speculative_ttl_s: float = 2.0
    deaths: float = 0.0  # share of the replicas that die together (at least one when > 0)
    joins: float = 0.0  # share of replicas (beyond `replicas`) that join together
    change_at: float = 0.5  # where in the timed window the deaths and joins happen
    seed: int = 0

    def __post_init__(self) -> None:
        checks = {"replicas": self.replicas >= 1, "warmup_s": 0 <= self.warmup_s < self.seconds,
                  "rate_per_replica": self.rate_per_replica > 0, "deaths": 0 <= self.deaths < 1,
                  "joins": self.joins >= 0, "change_at": 0 <= self.change_at <= 1}
        for name, ok in checks.items():
            if not ok:
                raise InvalidInputError(f"{name} {getattr(self, name)!r} is out of range", param=name)


@dataclass(frozen=True)
class Chat:
    id: int
    at: float
    user: int
    facts: tuple[str, ...]


def zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (i + 1) ** s for i in range(n)]


def trace(sc: Scenario) -> list[Chat]:
    """Poisson arrivals; the user by Zipf over all users, then k distinct facts of theirs by Zipf."""
    rng = random.Random(sc.seed)
    users = sc.replicas * sc.users_per_replica
    user_cum = list(accumulate(zipf_weights(users, sc.user_zipf)))
    fact_w = zipf_weights(sc.facts_per_user, sc.fact_zipf)
    chats, t = [], 0.0
    rate = sc.rate_per_replica * sc.replicas
    while True:
        t += rng.expovariate(rate)
        if t >= sc.seconds:
            return chats
        user = rng.choices(range(users), cum_weights=user_cum)[0]
        picks = _sample(rng, fact_w, min(sc.k, sc.facts_per_user))
        chats.append(Chat(len(chats), t, user, tuple(f"u{user}.f{j}" for j in picks)))


def _sample(rng: random.Random, weights: list[float], k: int) -> list[int]:
    """k distinct indices, drawn by weight without replacement (Efraimidis-Spirakis keys)."""
    keys = [rng.random() ** (1.0 / w) for w in weights]
    return sorted(range(len(weights)), key=keys.__getitem__, reverse=True)[:k]


class Replica:
    """One simulated replica: its tiers, its batch and its queue."""

    def __init__(self, url: str, costs: Costs, ram_bytes: int) -> None:
        self.url, self.costs, self.ram_bytes = url, costs, ram_bytes
        self.alive = True
        self.ram: OrderedDict[str, None] = OrderedDict()  # LRU, oldest first
        self.disk: set[str] = set()
        self.running: dict[int, tuple[Chat, float, float]] = {}  # chat id -> (chat, first token at, done at)
        self.waiting: deque[Chat] = deque()
        self.served = 0

    @property
    def queued(self) -> int:
        return len(self.running) + len(self.waiting)

    def serve(self, chat: Chat, now: float, max_tokens: int) -> tuple[float, float, dict[str, int], list, list]:
        """Starts `chat` now: -> (first token at, done at, facts by tier found, tier changes
        stored, tier changes removed). Every fact ends up in RAM and on disk."""
        found = {RAM: 0, DISK: 0, "pull": 0}
        ttft = self.costs.base_s
        stored, removed = [], []
        for fact in chat.facts:
            tier = RAM if fact in self.ram else DISK if fact in self.disk else None
            found[tier or "pull"] += 1
            ttft += self.costs.fact_s(tier)
            if tier == RAM:
                self.ram.move_to_end(fact)
                continue
            if tier is None:
                self.disk.add(fact)
                stored.append((fact, DISK))
            self.ram[fact] = None
            stored.append((fact, RAM))
        while len(self.ram) * self.costs.fact_bytes > self.ram_bytes:
            removed.append((self.ram.popitem(last=False)[0], RAM))
        first = now + ttft
        done = first + (max_tokens - 1) * self.costs.decode_s
        self.running[chat.id] = (chat, first, done)
        self.served += 1
        return first, done, found, stored, removed


@dataclass
class Tally:
    ttft: list[float] = field(default_factory=list)
    found: dict[str, int] = field(default_factory=lambda: {RAM: 0, DISK: 0, "pull": 0})
    completed: list[int] = field(default_factory=list)
    cut: list[int] = field(default_factory=list)
    resent: int = 0
    before: dict[int, str] = field(default_factory=dict)  # user -> replica of their last chat before the change
    after: dict[int, str] = field(default_factory=dict)  # user -> replica of their first chat after


class Cluster:
    """The event loop: arrivals from the trace; first tokens, completions and publications from
    the replicas; one membership change (deaths, joins) at most."""

    def __init__(self, sc: Scenario, policy: str, costs: Costs, weights: Weights | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}")
        self.sc, self.policy, self.costs = sc, policy, costs
        joining = math.ceil(sc.joins * sc.replicas)
        self.replicas = {f"r{i}": Replica(f"r{i}", costs, sc.ram_mib * MIB) for i in range(sc.replicas + joining)}
        self.joined = list(self.replicas)[sc.replicas:]
        for url in self.joined:
            self.replicas[url].alive = False
        self.index = ResidencyIndex(sc.speculative_ttl_s)
        self.weights = weights or costs.weights(sc.k, sc.max_tokens)
        self.events: list = []  # (time, seq, kind, payload)
        self.seq = 0
        self.tally = Tally()
        self.died: list[str] = []
        self._order: dict[int, list[str]] = {}  # user -> every replica in rendezvous order
        self.full: set[str] = set()  # live replicas whose batch is full: a new chat would wait
        self.change_time = math.inf
        if sc.deaths > 0 or joining:
            self.change_time = sc.warmup_s + sc.change_at * (sc.seconds - sc.warmup_s)

    def push(self, at: float, kind: str, payload) -> None:
        self.seq += 1
        heapq.heappush(self.events, (at, self.seq, kind, payload))

    def run(self, chats: list[Chat]) -> Tally:
        if self.change_time < math.inf:
            self.push(self.change_time, "membership", None)
        for chat in chats:
            self.push(chat.at, "arrive", chat)
        while self.events:
            now, _, kind, payload = heapq.heappop(self.events)
            getattr(self, f"_on_{kind}")(now, payload)
        return self.tally

    def ranked(self, user: int) -> list[str]:
        """The live replicas in the user's rendezvous order (over every replica, then filtered:
        the same order rendezvous over the live ones gives)."""
        order = self._order.get(user)
        if order is None:
            order = self._order[user] = rendezvous(f"u{user}", list(self.replicas))
        return [u for u in order if self.replicas[u].alive]

    def route(self, chat: Chat, now: float) -> str:
        ranked = self.ranked(chat.user)
        if self.policy == "rendezvous":
            return ranked[0]
        sizes = dict.fromkeys(chat.facts, self.costs.fact_bytes)
        resident = self.index.resident(sizes, now)
        # Only replicas with a full batch make a chat wait; the others score as idle.
        load = {u: Load(self.replicas[u].queued, self.costs.slots) for u in self.full}
        best = residency_order(ranked, len(sizes) * self.costs.fact_bytes, resident, load, self.weights)[0]
        self.index.speculate(best, chat.facts, now)
        return best

    def _on_arrive(self, now: float, chat: Chat) -> None:
        url = self.route(chat, now)
        if chat.at >= self.sc.warmup_s:  # where each user was last before the change, first after
            if now < self.change_time:
                self.tally.before[chat.user] = url
            else:
                self.tally.after.setdefault(chat.user, url)
        replica = self.replicas[url]
        replica.waiting.append(chat)
        self._start(replica, now)

    def _start(self, replica: Replica, now: float) -> None:
        while replica.waiting and len(replica.running) < self.costs.slots:
            chat = replica.waiting.popleft()
            first, done, found, stored, removed = replica.serve(chat, now, self.sc.max_tokens)
            if chat.at >= self.sc.warmup_s:
                for tier, n in found.items():
                    self.tally.found[tier] += n
            self.push(first, "first", (replica.url, chat))
            self.push(done, "done", (replica.url, chat.id))
            self.push(now + self.sc.publish_s, "publish", (replica.url, stored, removed))
        self._mark(replica)

    def _mark(self, replica: Replica) -> None:
        if replica.alive and replica.queued >= self.costs.slots:
            self.full.add(replica.url)
        else:
            self.full.discard(replica.url)

    def _on_first(self, now: float, payload) -> None:
        url, chat = payload
        if self.replicas[url].alive and chat.at >= self.sc.warmup_s:
            self.tally.ttft.append(now - chat.at)

    def _on_done(self, now: float, payload) -> None:
        url, chat_id = payload
        replica = self.replicas[url]
        if not replica.alive or chat_id not in replica.running:
            return
        del replica.running[chat_id]
        self.tally.completed.append(chat_id)
        self._start(replica, now)

    def _on_publish(self, now: float, payload) -> None:
        url, stored, removed = payload
        if not self.replicas[url].alive:
            return
        for fact, tier in stored:
            self.index.stored(url, fact, tier)
        for fact, tier in removed:
            self.index.removed(url, fact, tier)

    def _on_membership(self, now: float, _) -> None:
        for url in self.joined:
            self.replicas[url].alive = True
        live = [u for u, r in self.replicas.items() if r.alive and u not in self.joined]
        n = max(1, round(self.sc.deaths * len(live))) if self.sc.deaths > 0 else 0
        self.died = random.Random(self.sc.seed + 1).sample(live, min(n, len(live) - 1))
        for url in self.died:
            self._kill(self.replicas[url], now)

    def _kill(self, replica: Replica, now: float) -> None:
        """The replica is gone with its tiers; what it had not started streaming is sent again."""
        replica.alive = False
        self.index.drop(replica.url)
        lost = list(replica.waiting)
        for chat, first, _ in replica.running.values():
            if first <= now:  # streaming already: the client sees an error, nothing is re-sent
                self.tally.cut.append(chat.id)
            else:
                lost.append(chat)
        replica.running.clear()
        replica.waiting.clear()
        self._mark(replica)
        for chat in sorted(lost, key=lambda c: c.at):
            self.tally.resent += 1
            self._resend(chat, now)

    def _resend(self, chat: Chat, now: float) -> None:
        replica = self.replicas[self.route(chat, now)]
        replica.waiting.append(chat)
        self._start(replica, now)


def simulate(sc: Scenario, policy: str, costs: Costs = COSTS, chats: list[Chat] | None = None,
             weights: Weights | None = None) -> dict:
    """One run; -> its row (TTFT in seconds over the timed chats, shares of fact loads by tier).
    weights: the residency policy's (default: from `costs`)."""
    chats = trace(sc) if chats is None else chats
    cluster = Cluster(sc, policy, costs, weights)
    tally = cluster.run(chats)
    loads = sum(tally.found.values()) or 1
    moved = sorted(u for u, url in tally.after.items() if u in tally.before and tally.before[u] != url)
    served = [r.served for r in cluster.replicas.values()]
    return {"policy": policy, "replicas": sc.replicas, "deaths": len(cluster.died), "joins": len(cluster.joined),
            "chats": len(chats), "timed": len(tally.ttft),
            "ttft_p50": percentile(tally.ttft, 50), "ttft_p99": percentile(tally.ttft, 99),
            "resident_hit": (tally.found[RAM] + tally.found[DISK]) / loads, "ram_hit": tally.found[RAM] / loads,
            "pulls_per_chat": tally.found["pull"] / max(1, len(tally.ttft)),
            "load_max_over_mean": max(served) / (sum(served) / len(served)),
            "completed": len(tally.completed), "completed_ids": tally.completed,
            "cut": len(tally.cut), "cut_ids": tally.cut, "resent": tally.resent, "died": cluster.died,
            "users_moved": len(moved), "users_moved_off_dead": sum(tally.before[u] in cluster.died for u in moved),
            "users_seen_both": sum(u in tally.before for u in tally.after),
            "moved": moved}


def faster(costs: Costs, speedup: float) -> Costs:
    """A what-if, not a measurement: compute (the k=0 TTFT, injection, decode) `speedup` times
    faster, the tiers' reads as measured (a GPU does not make a Redis GET faster)."""
    return replace(costs, base_s=costs.base_s / speedup, inject_s=costs.inject_s / speedup,
                   decode_s=costs.decode_s / speedup)


def run(replicas=(2, 10, 100), deaths: float = 0.1, joins: float = 0.0, base: Scenario = Scenario(),
        costs: Costs = COSTS, speedup: float = 1.0) -> dict:
    """Every policy at every size: steady, with `deaths`, and with `joins` when > 0; both policies
    see the same trace. `speedup` > 1 divides the compute costs (faster())."""
    started = time.perf_counter()
    costs = faster(costs, speedup) if speedup != 1.0 else costs
    changes = {"steady": {}, "deaths": {"deaths": deaths}, **({"joins": {"joins": joins}} if joins > 0 else {})}
    rows = []
    for n in replicas:
        for name, change in changes.items():
            sc = replace(base, replicas=n, **change)
            chats = trace(sc)
            for policy in POLICIES:
                row = {"change": name, **simulate(sc, policy, costs, chats)}
                for key in ("moved", "completed_ids", "cut_ids"):
                    row.pop(key)
                rows.append(row)
    return {"bench": "cluster", "scenario": asdict(base), "death_share": deaths, "join_share": joins,
            "compute_speedup": speedup, "costs": asdict(costs), "sources": SOURCES, "rows": rows,
            "wall_s": time.perf_counter() - started}
