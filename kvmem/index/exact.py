"""`ExactIndex`: brute-force cosine search, one dense block per scope.

Exact is the right default at per-user memory sizes (a few thousand facts): one
matrix-vector product over the scope beats any graph index on recall and is fast enough.
Vectors are normalised on the way in, so the dot product is the cosine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from numbers import Integral
from typing import Any

import numpy as np

from kvmem.errors import InvalidInputError
from kvmem.index.base import EMPTY, Hit, Ranking, RowIds, VectorIndex, rank
from kvmem.index.block import ScopeBlock
from kvmem.index.checks import check_ids, check_metadatas, check_scope, unit_query, unit_rows
from kvmem.index.filters import Filters, matcher, validate_filters
from kvmem.index.rwlock import RWLock
from kvmem.index.scan import row_scores, scan_top_k


SCAN_FROM = 4096  # rows from which an unfiltered search reads the int8 copies first (kvmem.index.scan)


class ExactIndex(VectorIndex):
    def __init__(self, dim: int, scan_from: int = SCAN_FROM) -> None:
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise InvalidInputError(f"dim must be an int >= 1, got {dim!r}", param="dim")
        self.dim = dim
        self.scan_from = scan_from
        self._scopes: dict[str, ScopeBlock] = {}
        self._lock = RWLock()

    def add(
        self,
        scope_key: str,
        ids: Sequence[str],
        vectors: np.ndarray,
        metadatas: Sequence[Mapping[str, Any] | None] | None = None,
    ) -> None:
        check_scope(scope_key)
        ids = check_ids(ids)
        rows = unit_rows(vectors, len(ids), self.dim)  # [n, dim]
        metas = check_metadatas(metadatas, len(ids))
        if not ids:
            return
        with self._lock.write():
            block = self._scopes.get(scope_key)
            if block is None:
                block = self._scopes[scope_key] = ScopeBlock(self.dim)
            block.upsert(ids, rows, metas)

    def remove(self, scope_key: str, id: str) -> bool:
        check_scope(scope_key)
        check_ids([id])
        with self._lock.write():
            block = self._scopes.get(scope_key)
            if block is None or not block.remove(id):
                return False
            if not block:
                del self._scopes[scope_key]  # empty scopes would pile up, one per departed user
            return True

    def remove_scope(self, scope_key: str) -> int:
        check_scope(scope_key)
        with self._lock.write():
            block = self._scopes.pop(scope_key, None)
            return len(block) if block is not None else 0

    def search(
        self,
        scope_key: str,
        query: np.ndarray,
        k: int,
        filters: Mapping[str, Any] | Filters | None = None,
    ) -> list[Hit]:
        return self.ranked(scope_key, query, k, filters).hits()

    def ranked(self, scope_key: str, query: np.ndarray, k: int,
               filters: Mapping[str, Any] | Filters | None = None) -> Ranking:
        if isinstance(k, bool) or not isinstance(k, Integral) or k < 1:
            raise InvalidInputError(f"k must be an int >= 1, got {k!r}", param="k")
        check_scope(scope_key)
        q = unit_query(query, self.dim)  # [dim]
        conditions = validate_filters(filters)
        with self._lock.read():
            block = self._scopes.get(scope_key)
            if block is None:
                return EMPTY
            if not conditions and len(block) >= self.scan_from:
                return scan_top_k(block.live(), *block.live_codes(), block.ids, q, int(k))
            return _search_block(block, q, int(k), conditions)

    def similarities(self, scope_key: str, query: np.ndarray, ids: Sequence[str]) -> dict[str, float]:
        """Cosine of `query` [dim] with each of `ids` in the scope (ids not there are left out)."""
        check_scope(scope_key)
        q = unit_query(query, self.dim)  # [dim]
        with self._lock.read():
            block = self._scopes.get(scope_key)
            if block is None:
                return {}
            found = [i for i in ids if i in block.rows]
            rows = np.asarray([block.rows[i] for i in found], np.int64)  # [m]
            return dict(zip(found, row_scores(block.vectors, rows, q).tolist()))

    def export(self, scope_key: str) -> tuple[list[str], np.ndarray, list[dict[str, Any]]]:
        """The scope's ids, unit vectors [n, dim] and metadata, as copies (to move it to another
        index: GraphIndex.export is the same call the other way)."""
        with self._lock.read():
            block = self._scopes.get(scope_key)
            if block is None:
                return [], np.empty((0, self.dim), np.float32), []
            return list(block.ids), block.live().copy(), [dict(m) for m in block.metas]

    def count(self, scope_key: str) -> int:
        with self._lock.read():
            block = self._scopes.get(scope_key)
            return len(block) if block is not None else 0

    def __len__(self) -> int:
        with self._lock.read():
            return sum(len(b) for b in self._scopes.values())


def _search_block(block: ScopeBlock, q: np.ndarray, k: int, conditions: Filters) -> Ranking:
    """Filter first, then exact top-k over the rows that passed. Caller holds the read lock."""
    if not conditions:
        return rank(block.live() @ q, block.ids, k)  # [size, dim] @ [dim] -> [size]
    match = matcher(conditions)
    rows = block.filters.passing(conditions, lambda: np.asarray(
        [i for i, meta in enumerate(block.metas) if match(meta)], np.int64))  # [m]
    if not len(rows):
        return EMPTY
    return rank(row_scores(block.vectors, rows, q), RowIds(block.ids, rows), k)
