"""One scope's storage: a contiguous float32 block, its int8 copy (kvmem.index.scan reads
that first), and parallel id and metadata lists.

Rows [0, size) are live and dense. Removing a row moves the last row into its place, so
there are no tombstones to skip or compact and a search is a single matrix-vector product.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvmem.index.remembered import RememberedFilters
from kvmem.index.rowquant import quantize

MIN_CAPACITY = 16


class ScopeBlock:
    def __init__(self, dim: int) -> None:
        self.vectors = np.empty((MIN_CAPACITY, dim), dtype=np.float32)  # [capacity, dim]
        self.codes = np.empty((MIN_CAPACITY, dim), dtype=np.int8)  # [capacity, dim] vectors / scales
        self.scales = np.empty(MIN_CAPACITY, dtype=np.float32)  # [capacity]
        self.ids: list[str] = []  # ids[i] owns row i
        self.metas: list[dict[str, Any]] = []  # metas[i] describes row i
        self.rows: dict[str, int] = {}  # id -> row
        self.filters = RememberedFilters()  # rows passing recent filters, until the next write

    def __len__(self) -> int:
        return len(self.ids)

    def live(self) -> np.ndarray:
        """A view of the live rows, [size, dim]; only valid until the next write."""
        return self.vectors[: len(self.ids)]

    def live_codes(self) -> tuple[np.ndarray, np.ndarray]:
        """Views of the live rows' int8 codes [size, dim] and scales [size], as `live`."""
        return self.codes[: len(self.ids)], self.scales[: len(self.ids)]

    def upsert(self, ids: Sequence[str], vectors: np.ndarray, metas: Sequence[dict[str, Any]]) -> None:
        """Write rows [n, dim]; a known id keeps its row, a new one is appended."""
        self.filters.invalidate()
        last = {id_: i for i, id_ in enumerate(ids)}  # a batch repeating an id keeps its last copy
        self._reserve(len(self.ids) + len(last))
        targets, sources = [], []
        for id_, src in last.items():
            row = self.rows.get(id_)
            if row is None:
                row = self.rows[id_] = len(self.ids)
                self.ids.append(id_)
                self.metas.append(metas[src])
            else:
                self.metas[row] = metas[src]
            targets.append(row)
            sources.append(src)
        self.vectors[targets] = vectors[sources]  # [m, dim]
        self.codes[targets], self.scales[targets] = quantize(vectors[sources], np.int8)

    def remove(self, id_: str) -> bool:
        row = self.rows.pop(id_, None)
        if row is None:
            return False
        self.filters.invalidate()  # rows move: the last takes the removed one's place
        last = len(self.ids) - 1
        if row != last:
            self.vectors[row] = self.vectors[last]
            self.codes[row], self.scales[row] = self.codes[last], self.scales[last]
            self.ids[row] = self.ids[last]
            self.metas[row] = self.metas[last]
            self.rows[self.ids[row]] = row
        self.ids.pop()
        self.metas.pop()
        self._maybe_shrink()
        return True

    def _reserve(self, size: int) -> None:
        capacity = len(self.vectors)
        if size <= capacity:
            return
        while capacity < size:
            capacity *= 2  # geometric growth: appends cost O(1) amortised
        self._resize(capacity)

    def _maybe_shrink(self) -> None:
        # Shrink at a quarter full, to half: memory comes back without thrashing at the edge.
        capacity = len(self.vectors)
        if capacity > MIN_CAPACITY and len(self.ids) <= capacity // 4:
            self._resize(max(MIN_CAPACITY, capacity // 2))

    def _resize(self, capacity: int) -> None:
        size, dim = len(self.ids), self.vectors.shape[1]
        vectors, codes = np.empty((capacity, dim), np.float32), np.empty((capacity, dim), np.int8)
        scales = np.empty(capacity, np.float32)
        vectors[:size], codes[:size], scales[:size] = self.vectors[:size], self.codes[:size], self.scales[:size]
        self.vectors, self.codes, self.scales = vectors, codes, scales
