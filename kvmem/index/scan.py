"""Exact top-k over a scope's rows, read mostly from their int8 copies.

A search over 10k float32 rows of dim 384 reads 15 MB; between two searches of a serving
process that block has left the cache, and the scan runs at memory speed (~1.2 ms here, most of
a hybrid search). Each row also has an int8 copy with one scale (kvmem.index.rowquant, a
quarter of the bytes): the scan scores those, then re-scores in float32 every row that the
int8 error could lift into the top k. The int8 error of row i is at most s_i/2 per coordinate
(s_i = max|v_i|/127), so |<q, v_i> - approx_i| <= s_i/2 * |q|_1: a row whose approximate score
plus that bound falls below the k-th best exact score seen cannot be in the top k. The result
is the exact float32 top-k, not an estimate.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numba import njit

from kvmem.index.base import Ranking, RowIds, rank
from kvmem.index.heap import offer

_ROUNDING = 1e-4  # float32 accumulation error over 384 terms, with a wide margin


@njit(cache=True, fastmath=True, nogil=True)
def int8_scores(codes: np.ndarray, scales: np.ndarray, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Approximate cosines [n] of q [dim] with rows codes [n, dim] int8 * scales [n], and the
    rows of the k best of them [min(k, n)], unordered, selected while scoring (kvmem.index.heap)."""
    n = codes.shape[0]
    out = np.empty(n, np.float32)
    heap = np.empty(min(k, n), np.float32)
    rows = np.empty(min(k, n), np.int64)
    filled = 0
    for i in range(n):
        acc = np.float32(0.0)
        for j in range(codes.shape[1]):
            acc += np.float32(codes[i, j]) * q[j]
        out[i] = acc * scales[i]
        filled = offer(heap, rows, filled, out[i], i)
    return out, rows


@njit(cache=True, fastmath=True, nogil=True)
def row_scores(vectors: np.ndarray, rows: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Cosines [m] of q [dim] with vectors[rows] (vectors [n, dim] float32, rows [m]), read in
    place: `vectors[rows] @ q` first copies the rows (3.8 MB for a filter passing 2,500 of 10k),
    and allocating that per search cost as much as the products."""
    out = np.empty(rows.shape[0], np.float32)
    for i in range(rows.shape[0]):
        r = rows[i]
        acc = np.float32(0.0)
        for j in range(vectors.shape[1]):
            acc += vectors[r, j] * q[j]
        out[i] = acc
    return out


@njit(cache=True, nogil=True)
def _reaching(approx: np.ndarray, scales: np.ndarray, half_l1: float, floor: float) -> np.ndarray:
    """Rows whose approximate score [n] plus its error bound (scales [n] x half_l1, and the
    rounding margin) reaches `floor`: every row that could be in the top k. One pass, where numpy
    took four over the scope's rows."""
    out = np.empty(approx.shape[0], np.int64)
    m = 0
    for i in range(approx.shape[0]):
        if approx[i] + scales[i] * half_l1 + _ROUNDING >= floor:
            out[m] = i
            m += 1
    return out[:m]


def scan_top_k(vectors: np.ndarray, codes: np.ndarray, scales: np.ndarray, ids: Sequence[str],
               q: np.ndarray, k: int) -> Ranking:
    """The exact top-k of rows vectors [n, dim] float32 for q [dim], equal scores by id, reading
    the int8 codes [n, dim] with scales [n] for every row and float32 only for contenders."""
    approx, first = int8_scores(codes, scales, q, k)  # [n], [min(k, n)]: the k best by approximation
    # k rows score at least this exactly, so the k-th best row of all does too.
    floor = float(row_scores(vectors, first, q).min())
    contenders = _reaching(approx, scales, 0.5 * float(np.abs(q).sum()), floor)  # [c]
    return rank(row_scores(vectors, contenders, q), RowIds(ids, contenders), k)
