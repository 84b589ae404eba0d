"""Which replica a request goes to: rendezvous on the user, or by where its facts' KV already is.

For the gateway process, once per request (not wired into RemoteEngine yet; the cluster
simulator, kvmem/bench/cluster_sim.py, drives this same code). The facts a request needs are known before the
engine runs (retrieval chose them), so the router can send it where most of their KV is
resident (Tessera's point; issue 54). Residency is keyed by (replica, fact) for one model
fingerprint, not by prefix hashes as vLLM's KV events and llm-d's indexer key it: a fact's KV is
placed mid-prompt, so a prefix that stops at the first miss would count none of it.

- `ResidencyIndex` keeps what replicas published (`stored` / `removed` per fact and tier, in the
  spirit of vLLM's BlockStored / BlockRemoved) plus speculative entries: right after a decision
  the chosen replica is assumed to hold the request's facts for a TTL (as llm-d's
  precise-prefix-cache scorer does), so a burst from one user does not scatter before the first
  pull has been published. It holds no clock: callers pass `now`.
- `residency_order` is the policy, a pure function: each live replica's expected extra delay
  (bytes it would pull, bytes on its disk tier rather than in RAM, requests queued beyond its
  slots), least first, the caller's rendezvous order (remote.rendezvous) on ties. With nothing
  resident and no queue anywhere it is rendezvous, so a cold cluster routes as before.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kvmem.errors import InvalidInputError

RAM = "ram"
DISK = "disk"
TIERS = (RAM, DISK)
MIB = 1 << 20


@dataclass(frozen=True)
class Resident:
    """Bytes of one request's facts a replica holds, by its best tier."""

    ram: int = 0
    disk: int = 0


@dataclass(frozen=True)
class Load:
    """A replica's queue as its metrics report it: requests running plus waiting, and how many it
    runs at once (its batch, registered with its membership)."""

    queued: int = 0
    slots: int = 1


@dataclass(frozen=True)
class Weights:
    """What the score trades, in seconds, so that bytes and queue depth compare: the measured cost
    of a MiB pulled from the shared tier, of a MiB read from the local disk tier instead of RAM,
    and of one request ahead beyond the replica's slots (its service time over its slots)."""

    pull_s_per_mib: float
    disk_s_per_mib: float
    queue_s: float

    def __post_init__(self) -> None:
        for name in ("pull_s_per_mib", "disk_s_per_mib", "queue_s"):
            if getattr(self, name) < 0:
                raise InvalidInputError(f"{name} must be >= 0", param=name)


def expected_delay(request_bytes: int, resident: Resident, load: Load, weights: Weights) -> float:
    """Seconds a replica is expected to add to the request: pulls, disk reads and queueing."""
    missing = max(0, request_bytes - resident.ram - resident.disk)
    waiting = max(0, load.queued + 1 - load.slots)
    return (missing * weights.pull_s_per_mib + resident.disk * weights.disk_s_per_mib) / MIB + waiting * weights.queue_s


def residency_order(ranked: list[str], request_bytes: int, resident: Mapping[str, Resident],
                    load: Mapping[str, Load], weights: Weights) -> list[str]:
    """The live replicas, given in the user's rendezvous order (`rendezvous(user, live)`), best
    first for a request of `request_bytes` of facts: least expected delay, ties kept in rendezvous
    order (the sort is stable). Replicas absent from `resident` hold none of the facts; absent
    from `load`, nothing is queued there."""
    # Replicas that hold none of the facts and queue nothing all score alike: score each once.
    alike = expected_delay(request_bytes, Resident(), Load(), weights)
    scored = {url: expected_delay(request_bytes, resident.get(url, Resident()), load.get(url, Load()), weights)
              for url in ranked if url in resident or url in load}
    return sorted(ranked, key=lambda url: scored.get(url, alike))


class ResidencyIndex:
    """fact -> the replicas holding its KV and in which tiers, from the replicas' own reports, with
    speculative entries that expire. Not thread-safe: one router owns it."""

    def __init__(self, speculative_ttl_s: float = 2.0) -> None:
        if speculative_ttl_s < 0:
            raise InvalidInputError("speculative_ttl_s must be >= 0", param="speculative_ttl_s")
        self.ttl_s = speculative_ttl_s
        self._tiers: dict[str, dict[str, set[str]]] = {}  # fact -> replica -> tiers
        self._guess: dict[str, dict[str, float]] = {}  # fact -> replica -> until when assumed
        self._held: dict[str, set[str]] = {}  # replica -> facts it reported, for drop()

    def stored(self, replica: str, fact: str, tier: str) -> None:
        """`replica` reported `fact`'s KV in `tier`."""
        if tier not in TIERS:
            raise InvalidInputError(f"tier must be one of {TIERS}, not {tier!r}", param="tier")
        self._tiers.setdefault(fact, {}).setdefault(replica, set()).add(tier)
        self._held.setdefault(replica, set()).add(fact)

    def removed(self, replica: str, fact: str, tier: str | None = None) -> None:
        """`replica` dropped `fact` from `tier` (None: from every tier)."""
        holders = self._tiers.get(fact, {})
        tiers = holders.get(replica)
        if tiers is None:
            return
        tiers.difference_update(TIERS if tier is None else (tier,))
        if not tiers:
            del holders[replica]
            self._held[replica].discard(fact)
            if not holders:
                del self._tiers[fact]

    def drop(self, replica: str) -> None:
        """Forgets all a replica reported or was assumed to hold (it died or is draining)."""
        for fact in list(self._held.get(replica, ())):
            self.removed(replica, fact)
        self._held.pop(replica, None)
        for fact in list(self._guess):
            self._guess[fact].pop(replica, None)
            if not self._guess[fact]:
                del self._guess[fact]

    def speculate(self, replica: str, facts: Iterable[str], now: float) -> None:
        """Assume `replica` holds `facts` until now + TTL: it was just chosen for them."""
        until = now + self.ttl_s
        for fact in facts:
            self._guess.setdefault(fact, {})[replica] = until

    def resident(self, sizes: Mapping[str, int], now: float) -> dict[str, Resident]:
        """The request's facts (fact -> blob bytes) -> replica -> the bytes it holds, by best tier;
        a speculative entry counts as RAM (the pull it stands for lands there)."""
        ram: dict[str, int] = {}
        disk: dict[str, int] = {}
        for fact, nbytes in sizes.items():
            guessed = self._guessed(fact, now)
            for replica, tiers in self._tiers.get(fact, {}).items():
                best = ram if RAM in tiers or replica in guessed else disk
                best[replica] = best.get(replica, 0) + nbytes
            for replica in guessed:
                if replica not in self._tiers.get(fact, ()):
                    ram[replica] = ram.get(replica, 0) + nbytes
        return {replica: Resident(ram.get(replica, 0), disk.get(replica, 0)) for replica in ram.keys() | disk.keys()}

    def assumed(self, fact: str, now: float) -> set[str]:
        """The replicas assumed (speculatively) to hold `fact` now."""
        return set(self._guessed(fact, now))

    def _guessed(self, fact: str, now: float) -> dict[str, float]:
        """The replicas still assumed to hold `fact`, dropping the expired."""
        guesses = self._guess.get(fact)
        if not guesses:
            return {}
        for replica in [r for r, until in guesses.items() if until <= now]:
            del guesses[replica]
        if not guesses:
            del self._guess[fact]
        return guesses
