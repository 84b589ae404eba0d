"""The `VectorIndex` interface, so an approximate (graph) index can replace the exact one."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvmem.index.filters import Filters


@dataclass(frozen=True)
class Hit:
    """One search result: cosine similarity, higher is more similar."""

    id: str
    score: float


def best_first(values: np.ndarray, id_of: Callable[[int], str]) -> np.ndarray:
    """Positions of `values` [m], highest first, equal values by id_of(position).

    Sorting (value, id) pairs in Python costs microseconds a pair, most of a top-100 search;
    numpy sorts the values, and only a ranking that holds equal values pays for the ids."""
    order = np.argsort(-values, kind="stable")  # [m]
    ranked = values[order]
    if len(ranked) > 1 and (ranked[1:] == ranked[:-1]).any():
        listed = values.tolist()
        return np.asarray(sorted(range(len(listed)), key=lambda i: (-listed[i], id_of(i))), dtype=np.int64)
    return order


@dataclass(frozen=True)
class Ranking:
    """A search's results as two columns, best first: what fusion reads, without a `Hit` per
    row (building 100 frozen Hits costs ~55 us here, a twentieth of a hybrid search at 10k facts)."""

    ids: list[str]
    scores: np.ndarray  # [m] float, highest first

    def hits(self) -> list[Hit]:
        return [Hit(i, s) for i, s in zip(self.ids, self.scores.tolist())]


EMPTY = Ranking([], np.zeros(0, dtype=np.float32))


class RowIds:
    """ids of `rows` by position, looked up only for the few rows a ranking returns."""

    def __init__(self, ids: Sequence[str | None], rows: np.ndarray) -> None:
        self.ids, self.rows = ids, rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> str:
        return self.ids[self.rows[i]]

    def take(self, positions: np.ndarray) -> list[str]:
        return [self.ids[r] for r in self.rows[positions].tolist()]


def _take(ids: Sequence[str] | RowIds, positions: np.ndarray) -> list[str]:
    if isinstance(ids, RowIds):
        return ids.take(positions)
    return [ids[i] for i in positions.tolist()]


def rank(scores: np.ndarray, ids: Sequence[str] | RowIds, k: int) -> Ranking:
    """The k best of `scores` [m] (ids[i] owns scores[i]), best first, equal scores by id."""
    if k < len(scores):
        part = np.argpartition(-scores, k - 1)[:k]  # [k], unordered
        # argpartition picks arbitrarily among scores equal to the k-th; take them all so
        # the id tie-break below decides, not the partition.
        candidates = np.flatnonzero(scores >= scores[part].min())  # [c >= k]
    else:
        candidates = np.arange(len(scores))
    values = scores[candidates]  # [c]
    order = best_first(values, lambda j: ids[int(candidates[j])])[:k]
    return Ranking(_take(ids, candidates[order]), values[order])


def top_k(scores: np.ndarray, ids: Sequence[str] | RowIds, k: int) -> list[Hit]:
    """`rank` as Hits."""
    return rank(scores, ids, k).hits()


class VectorIndex(ABC):
    """Vectors with metadata, partitioned by scope key (e.g. one scope per user)."""

    dim: int

    @abstractmethod
    def add(
        self,
        scope_key: str,
        ids: Sequence[str],
        vectors: np.ndarray,
        metadatas: Sequence[Mapping[str, Any] | None] | None = None,
    ) -> None:
        """Insert vectors [n, dim]; an id already in the scope is replaced."""

    @abstractmethod
    def remove(self, scope_key: str, id: str) -> bool:
        """Drop one id; False when it was not there."""

    @abstractmethod
    def remove_scope(self, scope_key: str) -> int:
        """Drop a whole scope; returns how many vectors it held."""

    @abstractmethod
    def search(
        self,
        scope_key: str,
        query: np.ndarray,
        k: int,
        filters: Mapping[str, Any] | Filters | None = None,
    ) -> list[Hit]:
        """Top-k ids of the scope by cosine with `query` [dim], best first, ties by id."""

    def ranked(self, scope_key: str, query: np.ndarray, k: int,
               filters: Mapping[str, Any] | Filters | None = None) -> Ranking:
        """`search` as a `Ranking`; an index with a cheaper way to build one overrides this."""
        hits = self.search(scope_key, query, k, filters)
        return Ranking([h.id for h in hits], np.asarray([h.score for h in hits], dtype=np.float32))

    @abstractmethod
    def count(self, scope_key: str) -> int:
        """How many vectors the scope holds."""

    @abstractmethod
    def __len__(self) -> int:
        """How many vectors all scopes hold together."""
