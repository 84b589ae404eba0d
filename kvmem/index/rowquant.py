"""The graph's re-rank vectors: int8 with one float32 scale per row, or plain float32.

A walk scores every node it expands (and the re-rank candidates) with these vectors, and
pruning measures distances with them. int8 rows cost a quarter of float32's memory (384 B +
4 B against 1,536 B at dim 384) and a quarter of the bytes read per expanded node; the price
is a score error: with scale s = max|v_i| / 127 each coordinate is off by at most s/2, so
|<q, v> - <q, v_hat>| <= (s/2) |q|_1, about 1e-3 in practice for unit 384-d vectors (typical,
not worst case; docs/benchmarks.md measures the recall this keeps). float32 rows (scale 1)
keep scores exact for callers that need that.
"""

from __future__ import annotations

import numpy as np

from kvmem.errors import InvalidInputError

DTYPES = {8: np.int8, 32: np.float32}


def dtype_for(bits: int) -> type:
    if bits not in DTYPES:
        raise InvalidInputError(f"vector_bits must be 8 or 32, got {bits!r}", param="vector_bits")
    return DTYPES[bits]


def quantize(rows: np.ndarray, dtype: type) -> tuple[np.ndarray, np.ndarray]:
    """Rows [n, dim] float32 -> (stored rows [n, dim] of `dtype`, scales [n] float32)."""
    rows = np.asarray(rows, np.float32)
    if dtype is np.float32:
        return rows, np.ones(len(rows), np.float32)
    peak = np.abs(rows).max(axis=1) if rows.size else np.zeros(len(rows), np.float32)  # [n]
    scales = np.where(peak > 0, peak / 127.0, 1.0).astype(np.float32)  # [n]
    stored = np.clip(np.rint(rows / scales[:, None]), -127, 127).astype(np.int8)  # [n, dim]
    return stored, scales


def decode(stored: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Stored rows [n, dim] and scales [n] -> float32 rows [n, dim] (exact for float32 storage)."""
    return stored.astype(np.float32) * scales[:, None]
