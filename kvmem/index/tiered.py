"""`TieredIndex`: exact scan for small scopes, the graph index for large ones, per scope.

A scope starts exact. When it reaches `promote_at` vectors it moves, in one batch build, to
a `GraphIndex`; when it falls below `demote_at` it moves back. The gap between the two keeps a
scope that hovers at the edge from being rebuilt on every add and delete. The thresholds come
from measurements (docs/benchmarks.md, "Graph index (Vamana + RaBitQ)"): an exact scan of
384-d vectors costs ~23 us per thousand on our 2-core machine (0.23 ms at 10k), a graph
search 0.1-0.25 ms at recall 0.95 whatever the size; the scan is exact and no slower up to
~10k-20k vectors, so per-user memories (a few thousand facts) never leave it, while an
agent's or organisation's shared scope does.

A demoted scope carries the graph's stored rows back (int8-rounded by default, about 1e-3 off
in cosine) until the service next rebuilds its indexes from the fact store's float32 embeddings.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvmem.errors import InvalidInputError
from kvmem.index.base import Hit, Ranking, VectorIndex
from kvmem.index.exact import ExactIndex
from kvmem.index.filters import Filters
from kvmem.index.graph import GraphIndex, GraphIndexConfig
from kvmem.index.rwlock import RWLock


@dataclass(frozen=True)
class TierConfig:
    promote_at: int = 20_000  # an exact scope this large moves to the graph
    demote_at: int = 10_000  # a graph scope this small moves back to exact
    graph: GraphIndexConfig = field(default_factory=GraphIndexConfig)

    def __post_init__(self) -> None:
        if not 0 <= self.demote_at < self.promote_at:
            raise InvalidInputError(f"need 0 <= demote_at < promote_at, got {self.demote_at}, {self.promote_at}",
                                    param="demote_at")


class TieredIndex(VectorIndex):
    def __init__(self, dim: int, config: TierConfig | None = None) -> None:
        self.config = config or TierConfig()
        self.exact = ExactIndex(dim)
        self.graph = GraphIndex(dim, self.config.graph)
        self.dim = dim
        self._graph_scopes: set[str] = set()
        self._lock = RWLock()  # writes (and moves between tiers) one at a time

    def tier(self, scope_key: str) -> VectorIndex:
        """The index that holds the scope now."""
        return self.graph if scope_key in self._graph_scopes else self.exact

    def add(self, scope_key: str, ids: Sequence[str], vectors: np.ndarray,
            metadatas: Sequence[Mapping[str, Any] | None] | None = None) -> None:
        with self._lock.write():
            self.tier(scope_key).add(scope_key, ids, vectors, metadatas)
            if scope_key not in self._graph_scopes and self.exact.count(scope_key) >= self.config.promote_at:
                self._move(scope_key, to_graph=True)

    def remove(self, scope_key: str, id: str) -> bool:
        with self._lock.write():
            removed = self.tier(scope_key).remove(scope_key, id)
            if scope_key in self._graph_scopes and self.graph.count(scope_key) < self.config.demote_at:
                self._move(scope_key, to_graph=False)
            return removed

    def remove_scope(self, scope_key: str) -> int:
        with self._lock.write():
            self._graph_scopes.discard(scope_key)
            return self.exact.remove_scope(scope_key) + self.graph.remove_scope(scope_key)

    def _move(self, scope_key: str, to_graph: bool) -> None:
        """Rebuild the scope in the other tier (one batch), then drop it from this one."""
        if to_graph:
            ids, vectors, metas = self.exact.export(scope_key)  # our write lock keeps the scope still
            self.graph.add(scope_key, ids, vectors, metas)
            self.exact.remove_scope(scope_key)
            self._graph_scopes.add(scope_key)
        else:
            ids, vectors, metas = self.graph.export(scope_key)
            if ids:
                self.exact.add(scope_key, ids, vectors, metas)
            self.graph.remove_scope(scope_key)
            self._graph_scopes.discard(scope_key)

    def search(self, scope_key: str, query: np.ndarray, k: int,
               filters: Mapping[str, Any] | Filters | None = None) -> list[Hit]:
        with self._lock.read():
            return self.tier(scope_key).search(scope_key, query, k, filters)

    def ranked(self, scope_key: str, query: np.ndarray, k: int,
               filters: Mapping[str, Any] | Filters | None = None) -> Ranking:
        with self._lock.read():
            return self.tier(scope_key).ranked(scope_key, query, k, filters)

    def similarities(self, scope_key: str, query: np.ndarray, ids: Sequence[str]) -> dict[str, float]:
        with self._lock.read():
            return self.tier(scope_key).similarities(scope_key, query, ids)

    def count(self, scope_key: str) -> int:
        with self._lock.read():
            return self.tier(scope_key).count(scope_key)

    def __len__(self) -> int:
        with self._lock.read():
            return len(self.exact) + len(self.graph)
