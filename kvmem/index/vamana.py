"""`VamanaGraph`: one updatable Vamana graph over unit vectors, addressed by integer slots.

Vamana (DiskANN): out-degree <= R, built by searching with a beam of L and RobustPrune with
alpha > 1, entered at the medoid. Inserts go in batches that grow geometrically (prefix
doubling, as ParlayANN/Jasper): the first nodes are linked one by one so the graph has a
shape, later batches are linked in parallel against the graph before them. Deletes are
tombstones (walked through, never returned); once `consolidate_share` of the slots are
tombstoned, FreshDiskANN's consolidation rewires around them and their slots are reused.

This class is not thread-safe for writes; `GraphIndex` serialises them.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from kvmem.errors import InvalidInputError
from kvmem.index import vamana_kernels as K
from kvmem.index.rabitq import RaBitQ
from kvmem.index.rowquant import decode, dtype_for, quantize

STAMP_LIMIT = 2**32 - 2**24  # reset visit stamps well before uint32 wraps


@dataclass(frozen=True)
class GraphParams:
    """Build and search knobs. Defaults measured on clustered 100k x 384 (docs/benchmarks.md)."""

    degree: int = 48  # R, max out-degree (R32 needed beam 36 for recall 0.95 at 100k, R48 needs 20)
    build_beam: int = 64  # L while inserting (L48: recall 0.79 at beam 36 on 300k, L64: 0.95)
    alpha: float = 1.2  # RobustPrune's long-edge factor
    slack: float = 1.3  # rows hold up to slack * R edges before a re-prune (DiskANN's factor)
    search_beam: int = 32  # L while searching up to beam_scale_from live nodes (raised to k when smaller)
    beam_scale_from: int = 100_000  # above this the default beam grows with sqrt(size): see default_beam
    rerank: int = 16  # unexpanded candidates scored with their stored rows after the walk
    vector_bits: int = 8  # stored rows for scoring and pruning: 8 (int8 + scale) or 32 (exact)
    max_batch_share: float = 0.02  # a batch links at most this share of the graph at once
    max_batch: int = 10_000
    consolidate_share: float = 0.1  # consolidate when this share of slots is tombstoned
    seed: int = 0
    threads: int = 0  # build threads; 0 = every core

    def __post_init__(self) -> None:
        if (self.degree < 2 or self.build_beam < self.degree or self.alpha < 1.0 or self.search_beam < 1
                or self.beam_scale_from < 1):
            raise InvalidInputError(f"bad graph parameters: {self}")
        if not 0.0 < self.consolidate_share <= 1.0:
            raise InvalidInputError(f"consolidate_share must be in (0, 1], got {self.consolidate_share}",
                                    param="consolidate_share")
        dtype_for(self.vector_bits)


_POOLS: dict[int, ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def run_chunks(threads: int, n: int, fn: Callable[[int, int, int], object]) -> list:
    """fn(t, lo, hi) over `threads` contiguous chunks of range(n), on a shared thread pool.

    The kernels release the GIL (nogil), so Python threads run them in parallel; this avoids
    numba's parallel=True, whose OpenMP layer spins for milliseconds per region on a busy host.
    """
    chunk = -(-n // threads) if n else 0
    spans = [(t, t * chunk, min(n, (t + 1) * chunk)) for t in range(threads) if t * chunk < n]
    if len(spans) <= 1:
        return [fn(*span) for span in spans]
    with _POOLS_LOCK:
        pool = _POOLS.get(threads) or _POOLS.setdefault(threads, ThreadPoolExecutor(threads, "kvmem-vamana"))
    return [f.result() for f in [pool.submit(fn, *span) for span in spans]]


class VamanaGraph:
    def __init__(self, dim: int, params: GraphParams = GraphParams(), capacity: int = 64) -> None:
        self.dim = dim
        self.params = params
        self.quantizer: RaBitQ | None = None  # fitted on the first batch
        self.size = 0  # slots [0, size) are in use or free
        self.entry = -1
        self.free: list[int] = []  # freed slots, reused before growing
        self._alloc(max(capacity, 16), words=0)
        self._tls = threading.local()  # per-thread visit stamps for concurrent searches

    # -- storage -----------------------------------------------------------------------------

    def _alloc(self, cap: int, words: int) -> None:
        self.vectors = np.zeros((cap, self.dim), dtype_for(self.params.vector_bits))  # [cap, dim]
        self.scales = np.ones(cap, np.float32)  # [cap] row i is vectors[i] * scales[i]
        self.codes = np.zeros((cap, words), np.uint64)  # [cap, W]
        self.factors = np.zeros(cap, np.float32)  # [cap]
        self.adj = np.zeros((cap, self.row), np.int32)  # [cap, R_slack]
        self.deg = np.zeros(cap, np.int32)  # [cap]
        self.deleted = np.zeros(cap, np.uint8)  # [cap] tombstones (and free slots)

    def _grow(self, need: int) -> None:
        cap = len(self.vectors)
        if need <= cap:
            return
        while cap < need:
            cap *= 2
        old = self._arrays()
        self._alloc(cap, self.codes.shape[1])
        for new, prev in zip(self._arrays(), old):
            new[: len(prev)] = prev
        self._tls = threading.local()  # visit arrays are sized to the capacity

    def _arrays(self) -> tuple[np.ndarray, ...]:
        return (self.vectors, self.scales, self.codes, self.factors, self.adj, self.deg, self.deleted)

    def rows(self, slots: np.ndarray) -> np.ndarray:
        """The stored unit rows of `slots` [m] as float32 [m, dim] (int8 ones decoded)."""
        return decode(self.vectors[slots], self.scales[slots])

    @property
    def row(self) -> int:
        """Adjacency row width: R plus slack."""
        return int(np.ceil(self.params.degree * self.params.slack))

    @property
    def live(self) -> int:
        return self.size - int(self.deleted[: self.size].sum())

    @property
    def tombstones(self) -> int:
        return self.size - len(self.free) - self.live

    # -- writes -------------------------------------------------------------------------------

    def add(self, rows: np.ndarray) -> np.ndarray:
        """Insert unit rows [n, dim]; returns their slots [n]."""
        n = len(rows)
        if n == 0:
            return np.empty(0, np.int32)
        if self.quantizer is None:
            self.quantizer = RaBitQ.fit(rows, self.params.seed)
            self.codes = np.zeros((len(self.vectors), self.quantizer.words), np.uint64)
        reuse = [self.free.pop() for _ in range(min(n, len(self.free)))]
        fresh = list(range(self.size, self.size + n - len(reuse)))
        self._grow(self.size + len(fresh))
        self.size += len(fresh)
        slots = np.asarray(reuse + fresh, np.int32)
        codes, factors = self.quantizer.encode(rows)
        self.vectors[slots], self.scales[slots] = quantize(rows, self.vectors.dtype.type)
        self.codes[slots] = codes
        self.factors[slots] = factors
        self.deg[slots] = 0
        self.deleted[slots] = 1  # unreachable and unreturnable until linked
        order = self._insertion_order(slots, rows)
        self._link(order)
        return slots

    def _insertion_order(self, slots: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Slots in the order to link them; into an empty graph the medoid goes first."""
        if self.entry >= 0:
            return slots
        medoid = int(np.argmax(rows @ self.quantizer.centroid))  # nearest the mean, for unit rows
        self.entry = int(slots[medoid])
        self.deleted[self.entry] = 0
        rest = np.delete(slots, medoid)
        return rest

    @property
    def threads(self) -> int:
        return self.params.threads or os.cpu_count() or 1

    def _link(self, slots: np.ndarray) -> None:
        p = self.params
        done = 0
        while done < len(slots):
            batch = int(min(max(1, self.live * p.max_batch_share), p.max_batch, len(slots) - done))
            part = slots[done: done + batch]
            self._insert_batch(part)
            self.deleted[part] = 0
            done += batch

    def _insert_batch(self, new: np.ndarray) -> None:
        """Search + prune for every node of `new` in parallel, then merge the reverse edges."""
        p = self.params
        b = len(new)
        out = np.empty((b, p.degree), np.int32)  # [b, R]
        out_deg = np.zeros(b, np.int32)  # [b]
        threads = min(self.threads, b)
        visited, stamps = self._scratch(threads, b)
        alpha = np.float32(p.alpha)

        def link(t: int, lo: int, hi: int) -> None:
            stamps[t] = K.link_range(new, lo, hi, self.entry, self.adj, self.deg, self.vectors, self.scales, self.codes,
                                     self.factors, self.quantizer.signs, self.deleted, p.build_beam, alpha,
                                     visited[t], stamps[t], out, out_deg)

        run_chunks(threads, b, link)
        targets, sources, bounds = K.reverse_edges(new, out, out_deg, self.adj, self.deg)
        groups = len(bounds) - 1
        run_chunks(min(self.threads, max(1, groups // 64)), groups,
                   lambda t, lo, hi: K.merge_range(targets, sources, bounds, lo, hi, self.adj, self.deg,
                                                   self.vectors, self.scales, alpha, p.degree))

    def _scratch(self, threads: int, walks: int) -> tuple[np.ndarray, list[int]]:
        """Per-thread visit arrays [threads, cap] and their last stamps, reset before uint32 wraps."""
        scratch = getattr(self, "_build", None)
        if (scratch is None or scratch[0].shape[0] < threads or scratch[0].shape[1] != len(self.vectors)
                or max(scratch[1]) + walks > STAMP_LIMIT):
            scratch = (np.zeros((max(threads, self.threads), len(self.vectors)), np.uint32),
                       [0] * max(threads, self.threads))
            self._build = scratch
        return scratch

    def delete(self, slots: np.ndarray) -> None:
        """Tombstone slots; consolidates once enough of the graph is tombstoned."""
        self.deleted[np.asarray(slots, np.int64)] = 1
        if self.tombstones >= max(1, self.params.consolidate_share * (self.size - len(self.free))):
            self.consolidate()

    def consolidate(self) -> None:
        """Rewire live nodes around tombstones, then free the tombstoned slots."""
        dead = np.flatnonzero(self.deleted[: self.size])
        dead = np.setdiff1d(dead, np.asarray(self.free, np.int64), assume_unique=True)
        if len(dead) == 0:
            return
        alpha = np.float32(self.params.alpha)
        run_chunks(self.threads, self.size,
                   lambda t, lo, hi: K.consolidate_range(lo, hi, self.adj, self.deg, self.vectors, self.scales,
                                                        self.deleted, alpha, self.params.degree))
        self.deg[dead] = 0
        self.free.extend(int(s) for s in dead)
        if self.deleted[self.entry]:
            self._move_entry()

    def _move_entry(self) -> None:
        live = np.flatnonzero(self.deleted[: self.size] == 0)
        if len(live) == 0:
            self.entry = -1
            return
        self.entry = int(live[np.argmax(self.rows(live) @ self.quantizer.centroid)])  # [m]

    # -- reads --------------------------------------------------------------------------------

    def _visited(self) -> tuple[np.ndarray, int]:
        tls = self._tls
        stamp = getattr(tls, "stamp", STAMP_LIMIT)
        if stamp >= STAMP_LIMIT or len(tls.visited) != len(self.vectors):
            tls.visited = np.zeros(len(self.vectors), np.uint32)
            stamp = 0
        tls.stamp = stamp + 1
        return tls.visited, tls.stamp

    def default_beam(self) -> int:
        """The search beam when none is given: `search_beam` up to `beam_scale_from` nodes, then
        search_beam * sqrt(nodes / beam_scale_from) (nodes: slots in use, tombstones included,
        so the count costs nothing per search).

        A fixed beam loses recall as the graph grows: on clustered 384-d sets (100 points per
        cluster) beam 32 gave recall@10 0.978 at 100k and 0.751 at 1M, where 0.95 needed ~100
        (docs/benchmarks.md, round 3); the square root gives 32 at 100k, 55 at 300k, 101 at 1M.
        """
        p = self.params
        return int(round(p.search_beam * math.sqrt(max(1.0, (self.size - len(self.free)) / p.beam_scale_from))))

    def search(self, q: np.ndarray, k: int, beam: int | None = None,
               blocked: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Best k slots (ids [<=k] int32, exact scores [<=k]) for unit q [dim], best first."""
        if self.entry < 0:
            return np.empty(0, np.int32), np.empty(0, np.float32)
        visited, stamp = self._visited()
        return K.search_one(q, self.entry, self.adj, self.deg, self.vectors, self.scales, self.codes, self.factors,
                            self.quantizer.signs, self.deleted if blocked is None else blocked,
                            beam or self.default_beam(), self.params.rerank, k, visited, stamp)

    def search_many(self, queries: np.ndarray, k: int, beam: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Top-k for unit queries [m, dim] on all threads: slots [m, k] (-1 pads), scores [m, k].

        Shares the build scratch: call it from one thread, not during writes.
        """
        m = len(queries)
        ids = np.full((m, k), -1, np.int32)  # [m, k]
        scores = np.full((m, k), -np.inf, np.float32)  # [m, k]
        if self.entry < 0 or m == 0:
            return ids, scores
        threads = min(self.threads, m)
        visited, stamps = self._scratch(threads, m)
        beam = beam or self.default_beam()

        def walk(t: int, lo: int, hi: int) -> None:
            stamps[t] = K.search_range(queries, lo, hi, self.entry, self.adj, self.deg, self.vectors, self.scales,
                                       self.codes, self.factors, self.quantizer.signs, self.deleted, beam,
                                       self.params.rerank, k, visited[t], stamps[t], ids, scores)

        run_chunks(threads, m, walk)
        return ids, scores

    def nbytes(self) -> int:
        """Bytes of the arrays a search reads (rows, scales, codes, factors, graph, flags)."""
        return sum(a.nbytes for a in self._arrays())

    # -- persistence --------------------------------------------------------------------------

    def state(self) -> dict[str, np.ndarray]:
        """Arrays that reproduce this graph exactly (see `from_state`)."""
        n = self.size
        q = self.quantizer
        return {
            "vectors": self.vectors[:n], "scales": self.scales[:n],
            "codes": self.codes[:n], "factors": self.factors[:n],
            "adj": self.adj[:n], "deg": self.deg[:n], "deleted": self.deleted[:n],
            "free": np.asarray(self.free, np.int64),
            "meta": np.asarray([self.dim, n, self.entry], np.int64),
            "signs": q.signs if q else np.zeros((0, 64), np.float32),
            "centroid": q.centroid if q else np.zeros(self.dim, np.float32),
        }

    @classmethod
    def from_state(cls, state: dict[str, np.ndarray], params: GraphParams) -> "VamanaGraph":
        dim, n, entry = (int(x) for x in state["meta"])
        g = cls(dim, params, capacity=max(n, 16))
        if len(state["signs"]):
            g.quantizer = RaBitQ(np.ascontiguousarray(state["signs"]), np.ascontiguousarray(state["centroid"]))
        g.codes = np.zeros((len(g.vectors), state["codes"].shape[1]), np.uint64)
        for name in ("codes", "factors", "adj", "deg", "deleted"):
            getattr(g, name)[:n] = state[name]
        stored = state["vectors"]
        scales = state["scales"] if "scales" in state else np.ones(n, np.float32)  # format 1: float32 rows
        if stored.dtype != g.vectors.dtype:  # saved with other vector_bits: re-store in this graph's
            stored, scales = quantize(decode(stored, scales), g.vectors.dtype.type)
        g.vectors[:n], g.scales[:n] = stored, scales
        g.size, g.entry, g.free = n, entry, [int(s) for s in state["free"]]
        return g
