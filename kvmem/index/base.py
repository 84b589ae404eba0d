"""The `VectorIndex` interface, so an approximate (graph) index can replace the exact one."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvmem.index.filters import Filters


@dataclass(frozen=True)
class Hit:
    """One search result: cosine similarity, higher is more similar."""

    id: str
    score: float


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

    @abstractmethod
    def count(self, scope_key: str) -> int:
        """How many vectors the scope holds."""

    @abstractmethod
    def __len__(self) -> int:
        """How many vectors all scopes hold together."""
