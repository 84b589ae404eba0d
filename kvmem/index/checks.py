"""Input checks for the index: refuse bad input before any state changes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kvmem.errors import InvalidInputError


def check_scope(scope_key: Any) -> None:
    if not isinstance(scope_key, str):
        raise InvalidInputError(f"scope_key must be a str, got {type(scope_key).__name__}", param="scope_key")


def check_ids(ids: Sequence[str]) -> list[str]:
    if isinstance(ids, str) or not isinstance(ids, Sequence):
        raise InvalidInputError(f"ids must be a list of strings, got {type(ids).__name__}", param="ids")
    for id_ in ids:
        if not isinstance(id_, str) or not id_:
            raise InvalidInputError(f"ids must be non-empty strings, got {id_!r}", param="ids")
    return list(ids)


def check_metadatas(metadatas: Sequence[Mapping[str, Any] | None] | None, n: int) -> list[dict[str, Any]]:
    """Copies, so a caller mutating its dicts later cannot change what filters see."""
    if metadatas is None:
        return [{} for _ in range(n)]
    if isinstance(metadatas, Mapping) or len(metadatas) != n:
        raise InvalidInputError(f"metadatas must be a list with one dict per id ({n})", param="metadata")
    for meta in metadatas:
        if meta is not None and not isinstance(meta, Mapping):
            raise InvalidInputError(f"each metadata must be a dict or None, got {type(meta).__name__}",
                                    param="metadata")
    return [dict(meta or {}) for meta in metadatas]


def unit_rows(vectors: np.ndarray, n: int, dim: int, *, param: str = "vectors") -> np.ndarray:
    """`vectors` as float32 [n, dim] rows of norm 1; refuses wrong shapes, NaN/inf and zero rows
    (naming `param`, the argument they came in: a query's rows are checked here too)."""
    rows = np.asarray(vectors, dtype=np.float32)
    if rows.ndim != 2 or rows.shape[1] != dim:
        raise InvalidInputError(f"vectors must have shape [n, {dim}], got {list(rows.shape)}", param=param)
    if rows.shape[0] != n:
        raise InvalidInputError(f"got {rows.shape[0]} vectors for {n} ids", param=param)
    if not np.isfinite(rows).all():
        raise InvalidInputError("vectors contain NaN or infinity", param=param)
    norms = np.linalg.norm(rows, axis=1, keepdims=True)  # [n, 1]
    if (norms == 0).any():
        raise InvalidInputError("a zero vector has no direction to compare by cosine", param=param)
    return rows / norms  # [n, dim]


def unit_query(query: np.ndarray, dim: int) -> np.ndarray:
    """`query` as a float32 [dim] vector of norm 1."""
    q = np.asarray(query, dtype=np.float32)
    if q.ndim != 1 or q.shape[0] != dim:
        raise InvalidInputError(f"query must have shape [{dim}], got {list(q.shape)}", param="query")
    return unit_rows(q[None, :], 1, dim, param="query")[0]  # [dim]
