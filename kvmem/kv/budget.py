"""Which fact blobs stay on disk: a byte budget, a per-tenant quota, and LFU with dynamic aging.

Nothing here touches files: the service asks `admit` after a blob is written and deletes the
victims it returns; `touch` records that a chat used a fact; `worth_readmitting` says whether an
evicted fact that a chat just needed is hot enough to re-encode.

Policy, and why: LFU-DA (Arlitt et al., "Evaluating content management techniques for Web proxy
caches", 2000). A fact's priority is L + F, where F counts the chats that used it and L (the
"age") rises to the priority of each evicted blob. Memory workloads are skewed (a few facts of a
user answer most questions), which frequency captures and recency does not; the aging term lets
a fact that was hot long ago fall out once newer facts overtake it. GDSF would divide by size
and weight by the cost of a miss, but a miss costs a text prefill of the fact's tokens, which is
proportional to its blob size, so cost/size is a constant and GDSF reduces to LFU-DA here.

Access counts of evicted facts are kept (up to `ghosts` of them), so a hot fact that was evicted
comes back with its history instead of starting cold; it is re-encoded only once it has been used
more often than the blob it would displace (`worth_readmitting`). The service saves the counts
(`changed_hits`) when it closes and hands them back (`remember`) when it opens, so a restart with
a smaller budget evicts the least-used blobs, not the oldest; counts since the last clean close
are lost in a crash.
"""

from __future__ import annotations

import heapq
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from kvmem.errors import InvalidInputError


@dataclass
class _Entry:
    tenant: str
    nbytes: int
    priority: float
    version: int


@dataclass
class _Heap:
    """Min-heap of (priority, version, fact id); entries are invalidated lazily by version."""

    items: list = field(default_factory=list)

    def push(self, fact_id: str, entry: _Entry) -> None:
        heapq.heappush(self.items, (entry.priority, entry.version, fact_id))

    def lowest(self, live: dict[str, _Entry], skip: str | None = None) -> str | None:
        """The live fact of lowest priority (other than `skip`), stale tops dropped on the way."""
        while self.items:
            priority, version, fact_id = self.items[0]
            entry = live.get(fact_id)
            if entry is None or entry.version != version:
                heapq.heappop(self.items)
                continue
            if fact_id != skip:
                return fact_id
            # `skip` is the lowest: look one deeper without losing it.
            top = heapq.heappop(self.items)
            try:
                return self.lowest(live)
            finally:
                heapq.heappush(self.items, top)
        return None


class DiskBudget:
    """The disk tier's accounting: bytes per tenant and in all, and the eviction order."""

    def __init__(self, budget_bytes: int | None = None, quota_bytes: int | None = None, ghosts: int = 1_000_000) -> None:
        for name, value in (("budget", budget_bytes), ("quota", quota_bytes)):
            if value is not None and value < 0:
                raise InvalidInputError(f"disk {name} must be >= 0 bytes or None (unlimited), got {value}",
                                        param=f"{name}_bytes")
        self.budget = budget_bytes
        self.quota = quota_bytes
        self.used = 0
        self.age = 0.0  # L: the priority of the last evicted blob
        self.evictions = 0
        self._live: dict[str, _Entry] = {}
        self._all = _Heap()
        self._tenants: dict[str, _Heap] = {}
        self._tenant_bytes: dict[str, int] = {}
        self._hits: OrderedDict[str, int] = OrderedDict()  # chats per fact, evicted ones too
        self._evicted_bytes: OrderedDict[str, int] = OrderedDict()  # size of each evicted blob
        self._ghosts = ghosts
        self._changed: set[str] = set()  # facts whose count changed since changed_hits()
        self._version = 0
        self._lock = threading.Lock()

    def touch(self, fact_ids) -> None:
        """Chats used these facts: their priority rises (blobs on disk) or is remembered (evicted)."""
        with self._lock:
            for fact_id in fact_ids:
                self._hits[fact_id] = self._hits.pop(fact_id, 0) + 1
                self._changed.add(fact_id)
                while len(self._hits) > self._ghosts:
                    self._hits.popitem(last=False)
                entry = self._live.get(fact_id)
                if entry is not None:
                    self._place(fact_id, entry.tenant, entry.nbytes)

    def admit(self, fact_id: str, tenant: str, nbytes: int) -> list[str]:
        """A blob of `nbytes` was written for `fact_id`: -> the facts whose blobs must go (maybe
        this one) so that the tenant's quota and the budget hold again."""
        with self._lock:
            self._drop(fact_id)
            self._evicted_bytes.pop(fact_id, None)
            self._place(fact_id, tenant, nbytes)
            victims = []
            while self.quota is not None and self._tenant_bytes.get(tenant, 0) > self.quota:
                victims.append(self._evict(self._tenants[tenant].lowest(self._live)))
            while self.budget is not None and self.used > self.budget:
                victims.append(self._evict(self._all.lowest(self._live)))
            return victims

    def worth_readmitting(self, fact_id: str, tenant: str) -> bool:
        """Should this evicted fact be re-encoded? Only when chats used it more often than the
        blob it would displace (TinyLFU's admission rule): aging alone would readmit any fact used
        again, and each readmission costs an encode. Compares with the single lowest blob."""
        with self._lock:
            nbytes = self._evicted_bytes.get(fact_id, 0)
            hits = self._hits.get(fact_id, 0)
            checks = []
            if self.quota is not None and self._tenant_bytes.get(tenant, 0) + nbytes > self.quota:
                checks.append(self._tenants.get(tenant, _Heap()))
            if self.budget is not None and self.used + nbytes > self.budget:
                checks.append(self._all)
            if nbytes > min(x for x in (self.budget, self.quota, float("inf")) if x is not None):
                return False  # can never fit
            for heap in checks:
                lowest = heap.lowest(self._live, skip=fact_id)
                if lowest is None or self._hits.get(lowest, 0) >= hits:
                    return False
            return True

    def remember(self, hits: dict[str, int]) -> None:
        """Counts saved by an earlier run; call before admitting the blobs they rank."""
        with self._lock:
            for fact_id, n in hits.items():
                self._hits[fact_id] = self._hits.pop(fact_id, 0) + n

    def hits(self, fact_id: str) -> int:
        """Chats that injected the fact: live, with the counts earlier runs saved."""
        with self._lock:
            return self._hits.get(fact_id, 0)

    def changed_hits(self) -> dict[str, int]:
        """The counts that changed since the last call (for saving them)."""
        with self._lock:
            changed = {f: self._hits[f] for f in self._changed if f in self._hits}
            self._changed.clear()
            return changed

    def forget(self, fact_id: str) -> None:
        """The fact was deleted (or its blob dropped by an update): no bytes, no history."""
        with self._lock:
            self._drop(fact_id)
            self._hits.pop(fact_id, None)
            self._evicted_bytes.pop(fact_id, None)
            self._changed.discard(fact_id)

    def holds(self, fact_id: str) -> bool:
        return fact_id in self._live

    def tenant_bytes(self, tenant: str) -> int:
        return self._tenant_bytes.get(tenant, 0)

    def __len__(self) -> int:
        return len(self._live)

    # -- under the lock -------------------------------------------------------------------------

    def _place(self, fact_id: str, tenant: str, nbytes: int) -> None:
        old = self._live.get(fact_id)
        if old is None:
            self.used += nbytes
            self._tenant_bytes[tenant] = self._tenant_bytes.get(tenant, 0) + nbytes
        self._version += 1
        entry = _Entry(tenant, nbytes, self.age + 1 + self._hits.get(fact_id, 0), self._version)
        self._live[fact_id] = entry
        if self.budget is None and self.quota is None:
            return  # nothing is ever evicted: no order to keep
        self._all.push(fact_id, entry)
        self._tenants.setdefault(tenant, _Heap()).push(fact_id, entry)
        if len(self._all.items) > 2 * len(self._live) + 1024:
            self._compact()

    def _compact(self) -> None:
        """Rebuild the heaps from the live entries: every touch pushes a new entry and leaves the
        old one to be dropped lazily, which a hot blob never is (it is never near the top)."""
        self._all = _Heap([(e.priority, e.version, f) for f, e in self._live.items()])
        heapq.heapify(self._all.items)
        self._tenants = {}
        for f, e in self._live.items():
            self._tenants.setdefault(e.tenant, _Heap()).items.append((e.priority, e.version, f))
        for heap in self._tenants.values():
            heapq.heapify(heap.items)

    def _drop(self, fact_id: str) -> _Entry | None:
        entry = self._live.pop(fact_id, None)
        if entry is not None:
            self.used -= entry.nbytes
            self._tenant_bytes[entry.tenant] -= entry.nbytes
            if not self._tenant_bytes[entry.tenant]:
                del self._tenant_bytes[entry.tenant]
                self._tenants.pop(entry.tenant, None)
        return entry

    def _evict(self, fact_id: str) -> str:
        entry = self._drop(fact_id)
        self.age = max(self.age, entry.priority)
        self.evictions += 1
        self._evicted_bytes[fact_id] = entry.nbytes
        while len(self._evicted_bytes) > self._ghosts:
            self._evicted_bytes.popitem(last=False)
        return fact_id
