"""The `Embedder` interface: text in, unit-length float32 vectors out.

Subclasses implement `_embed_batch` only; batching, input checks and the final
normalisation live here so every embedder behaves the same at the edges.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from kvmem.errors import InvalidInputError

DEFAULT_BATCH_SIZE = 32


class Embedder(ABC):
    """Maps texts to L2-normalised float32 rows, so a dot product is a cosine similarity."""

    name: str
    dim: int

    def __init__(self, batch_size: int = DEFAULT_BATCH_SIZE) -> None:
        self.batch_size = _check_batch_size(batch_size)

    def embed(self, texts: list[str], batch_size: int | None = None) -> np.ndarray:
        """Embed `texts` in batches of `batch_size` (default: the one given at construction).

        Returns float32 [len(texts), dim]; every row has norm 1.
        """
        _check_texts(texts)
        size = self.batch_size if batch_size is None else _check_batch_size(batch_size)
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        parts = [self._embed_batch(list(texts[i : i + size])) for i in range(0, len(texts), size)]
        return l2_normalize(np.concatenate(parts, axis=0))  # [n, dim]

    @abstractmethod
    def _embed_batch(self, texts: list[str]) -> np.ndarray:
        """Raw vectors for one batch: float [len(texts), dim], not necessarily normalised."""


def l2_normalize(vectors: np.ndarray) -> np.ndarray:
    """Rows scaled to norm 1, as float32. [n, dim] -> [n, dim]."""
    vectors = np.asarray(vectors, dtype=np.float32)
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)  # [n, 1]
    # A zero row cannot be normalised; leave it zero rather than fill it with NaN.
    return vectors / np.maximum(norms, np.finfo(np.float32).tiny)


def _check_texts(texts: list[str]) -> None:
    if isinstance(texts, str) or not isinstance(texts, (list, tuple)):
        raise InvalidInputError(f"embed() takes a list of strings, got {type(texts).__name__}", param="texts")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise InvalidInputError(f"text #{i} is {type(text).__name__}, not str", param=f"texts[{i}]")
        if not text.strip():
            raise InvalidInputError(f"text #{i} is empty", param=f"texts[{i}]")


def _check_batch_size(batch_size: int) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InvalidInputError(f"batch_size must be an int >= 1, got {batch_size!r}", param="batch_size")
    return batch_size
