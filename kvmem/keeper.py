"""The blob keeper: each fact's KV blob from encoding to eviction.

It owns the encoder (encoding.py: pending facts -> blobs, in the background), the disk budget
(kv/budget.py: the least-used blobs are evicted past a disk budget or a tenant quota; their facts
are served by text and come back when chats use them enough), the start-up check of blobs marked
encoded, the re-queue of blobs that failed at serving time, and the tier counters.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Iterable

from kvmem.config import KVConfig
from kvmem.connector.plan import InjectionReport
from kvmem.encoding import EncodeReport, Encoder
from kvmem.errors import EngineError, InvalidInputError, UnknownFactError
from kvmem.facts.store import MAX_LIMIT, FactRecord
from kvmem.kv.budget import DiskBudget
from kvmem.kv.store import KVStore

ENCODE_MODES = ("sync", "background", "none")


@dataclass(frozen=True)
class KVTiers:
    """The KV tiers at a glance. Disk: facts of KV-mode chats served from a blob or as text,
    since this KVMem was opened. RAM: blob loads of the engine's worker served from its RAM tier
    or read from disk, since the engine started (as of the last chat)."""

    ram_budget_bytes: int
    disk_bytes: int
    disk_budget_bytes: int | None
    tenant_quota_bytes: int | None
    disk_blobs: int
    disk_hits: int
    disk_misses: int
    ram_hits: int
    ram_misses: int
    evictions: int
    readmissions: int

    def as_dict(self) -> dict[str, int | None]:
        return asdict(self)


@dataclass(frozen=True)
class BlobInfo:
    """Where a fact's KV blob is, as this process sees it (the engine's RAM tier is its own)."""

    tier: str | None  # "disk" (this machine's folder), "shared" (only in the shared tier), None: no blob
    bytes: int
    uses: int  # chats that injected it, as the disk budget counts them
    codec: str = ""  # what the local blob was written with (kv/codec.py); "" when not on this machine


@dataclass(frozen=True)
class ScopeSummary:
    user_id: str
    agent_id: str | None
    run_id: str | None
    facts: int
    kv_bytes: int  # of their blobs in this machine's folder


class BlobKeeper:
    def __init__(self, kv: KVStore, facts, config: KVConfig, lock: threading.RLock,
                 encoder: Encoder | None) -> None:
        """`encoder` None: opened without an engine (nothing is encoded or evicted)."""
        self.kv, self.facts, self.config = kv, facts, config
        self.encoder = encoder
        self._lock = lock
        self.budget = self._new_budget()
        self.budget.remember(facts.usage())  # the eviction order, and the uses blob() reports
        self.stats: Counter[str] = Counter()  # chats per mode, fallbacks, tier hits, evictions
        if encoder is not None:
            encoder.on_encoded = self.admit
            self.check_at_start()

    def _new_budget(self) -> DiskBudget:
        return DiskBudget(KVConfig.mib_to_bytes(self.config.disk_budget_mib),
                          KVConfig.mib_to_bytes(self.config.tenant_quota_mib))

    def check_at_start(self) -> None:
        """Facts marked encoded whose blob is gone, truncated or another fact's (a header check,
        no checksum) become pending, so kv_status tells the truth; the intact ones are counted
        against the disk budget (evicted now if it shrank)."""
        for record in all_records(self.facts):
            if record.kv_status == "encoded":
                if self.kv.intact(record.id):
                    self.admit(record)
                else:
                    self.facts.set_kv_status(record.id, "pending")

    # -- encoding -------------------------------------------------------------------------------

    def need_encoder(self) -> Encoder:
        if self.encoder is None:
            raise EngineError("this KVMem was opened without an engine (start_engine=False)")
        return self.encoder

    def encode(self, records: list[FactRecord], mode: str) -> EncodeReport | None:
        """Encode new or changed facts now ("sync"), later ("background") or not ("none")."""
        check_encode_mode(mode)
        if not records or mode == "none" or self.encoder is None:
            return None
        if mode == "background":
            self.encoder.kick()
            return None
        return self.encoder.encode(records)

    def queue_depth(self) -> int:
        """Facts waiting for their KV (0 without an encoder)."""
        return self.encoder.queue_depth() if self.encoder is not None else 0

    # -- the budget -----------------------------------------------------------------------------

    def admit(self, record: FactRecord) -> None:
        """A blob was written for this fact: count it, and evict what the budget no longer holds."""
        stamp = self.kv.stamp(record.id)
        if stamp is None:
            return
        for victim in self.budget.admit(record.id, record.scope.user_id, stamp[1]):
            self._evict(victim)

    def _evict(self, fact_id: str) -> None:
        with self._lock:
            self.kv.delete(fact_id)
            try:
                self.facts.set_kv_status(fact_id, "evicted")
            except UnknownFactError:  # deleted meanwhile
                pass
        self.stats["kv_evictions"] += 1

    def forget(self, fact_id: str) -> None:
        """The fact is gone: no longer counted against the budget."""
        self.budget.forget(fact_id)

    def drop(self, fact_id: str) -> None:
        """Its blob must never serve again (the fact was deleted, or its text changed)."""
        self.kv.delete(fact_id)
        self.budget.forget(fact_id)

    def reset(self) -> None:
        """Every blob gone (the caller holds the write lock and resets the store after)."""
        for record in all_records(self.facts):
            self.kv.delete(record.id)
        self.budget = self._new_budget()

    # -- after each chat ------------------------------------------------------------------------

    def after_chat(self, mode: str, facts: list[FactRecord], report: InjectionReport | None) -> None:
        """Count the chat, mark its facts used, and re-queue the blobs that could not serve it."""
        report = report or InjectionReport()
        self.stats[f"chat_{mode}"] += 1
        self.stats["fallbacks"] += report.facts_as_text
        if mode == "kv":
            self.budget.touch(f.id for f in facts)
            self.stats["kv_disk_hits"] += report.facts_from_blobs
            self.stats["kv_disk_misses"] += len(facts) - report.facts_from_blobs
            # The engine's worker counts since it started: keep the newest.
            self.stats["kv_ram_hits"] = max(self.stats["kv_ram_hits"], report.ram_tier_hits)
            self.stats["kv_ram_misses"] = max(self.stats["kv_ram_misses"], report.ram_tier_loads)
        self.requeue(report.fallbacks)

    def requeue(self, fact_ids: Iterable[str]) -> None:
        """A blob that failed at serving time gets re-encoded in the background; an evicted one
        only once chats have used it more than the least-used blob that it would displace."""
        requeued = False
        for fact_id in fact_ids:
            if not fact_id.startswith("f-"):  # the prompt's head, not a fact
                continue
            try:
                record = self.facts.get(fact_id)
                if record.kv_status == "evicted":
                    if not self.budget.worth_readmitting(fact_id, record.scope.user_id):
                        continue
                    self.stats["kv_readmissions"] += 1
                self.facts.set_kv_status(fact_id, "pending")
                requeued = True
            except UnknownFactError:  # deleted meanwhile: nothing to re-encode
                pass
        if requeued and self.encoder is not None:
            self.encoder.kick()

    def blob(self, fact_id: str) -> BlobInfo:
        uses = self.budget.hits(fact_id)
        size = _size(self.kv.path(fact_id))
        if size is not None:
            return BlobInfo("disk", size, uses, self.kv.codec(fact_id) or "")
        stamp = self.kv.stamp(fact_id)
        return BlobInfo("shared", int(stamp[1]), uses) if stamp is not None else BlobInfo(None, 0, uses)

    def scopes(self, user_prefix: str = "") -> list[ScopeSummary]:
        """Each scope of the users whose id starts with `user_prefix`: facts and blob bytes on disk."""
        totals: dict[tuple, list[int]] = {}
        for fact_id, scope in self.facts.scope_ids(user_prefix):
            entry = totals.setdefault((scope.user_id, scope.agent_id, scope.run_id), [0, 0])
            entry[0] += 1
            entry[1] += _size(self.kv.path(fact_id)) or 0
        return [ScopeSummary(*key, n, size) for key, (n, size) in totals.items()]

    def tiers(self) -> KVTiers:
        s = self.stats
        return KVTiers(
            ram_budget_bytes=self.config.hot_cache_mib << 20, disk_bytes=self.budget.used,
            disk_budget_bytes=self.budget.budget, tenant_quota_bytes=self.budget.quota, disk_blobs=len(self.budget),
            disk_hits=s["kv_disk_hits"], disk_misses=s["kv_disk_misses"], ram_hits=s["kv_ram_hits"],
            ram_misses=s["kv_ram_misses"], evictions=s["kv_evictions"], readmissions=s["kv_readmissions"])

    def close(self) -> None:
        if self.encoder is not None:
            self.encoder.stop()
            self.facts.save_usage(self.budget.changed_hits())  # the eviction order survives a restart


def _size(path) -> int | None:
    """A blob file's bytes; None when there is none (evicted or deleted, even between two calls)."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return None


def check_encode_mode(mode: object) -> None:
    if mode not in ENCODE_MODES:
        raise InvalidInputError(f"encode must be one of {ENCODE_MODES}, got {mode!r}", param="encode")


def all_records(facts) -> Iterable[FactRecord]:
    """Every stored fact, a page at a time."""
    offset = 0
    while page := facts.list(limit=MAX_LIMIT, offset=offset):
        yield from page
        offset += len(page)
