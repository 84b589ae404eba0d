"""RaBitQ 1-bit codes: a random rotation, one sign bit per dimension, one correction factor.

For a unit vector o and the data centroid c, the residual r = o - c is rotated, x = P r/|r|,
and stored as its sign bits b (x_bar = sign(x)/sqrt(D)) plus f = |r| / sum|x_i|. For a query q,

    <o, q> = <c, q> + |r| <r/|r|, q>   and   <x_bar, P q> / <x_bar, x>  is unbiased for <r/|r|, q>

(Gao & Long, SIGMOD 2024), so the estimate is <c, q> + f * (2 S_b - S), where S_b sums the
rotated query over the set bits and S over all bits. The query is rounded to 4 bits per
dimension so S_b becomes four AND+popcount passes over 64-bit words; its rounding error is
far below the 1-bit code's. Ranking drops <c, q>: it is the same for every vector.

The codes live in uint64 words [n, D/64]; D is the dimension zero-padded to a power of two
(the rotation is orthogonal on the padded space, so inner products are kept).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from kvmem.index.intrinsics import popcount

QUERY_BITS = 4


def padded_dim(dim: int) -> int:
    """The rotation's dimension: a power of two (for the Hadamard transform), at least 64."""
    return max(64, 1 << (dim - 1).bit_length())


@dataclass(frozen=True)
class RaBitQ:
    """The codebook of one graph: rotation signs [ROUNDS, Dp] and centroid [dim], fixed once fitted.

    The rotation is ROUNDS rounds of (random sign flips, normalised Walsh-Hadamard transform)
    on the zero-padded vector: orthogonal, O(D log D) instead of a D x D matrix product (which
    cost more than the whole walk), and close enough to a random rotation for the estimate.
    """

    signs: np.ndarray  # [ROUNDS, Dp] of +-1
    centroid: np.ndarray  # [dim]

    @classmethod
    def fit(cls, sample: np.ndarray, seed: int) -> "RaBitQ":
        """Centroid from `sample` [n, dim]; seeded random signs."""
        dp = padded_dim(sample.shape[1])
        signs = np.random.default_rng(seed).choice(np.float32([-1.0, 1.0]), size=(ROUNDS, dp))
        return cls(signs.astype(np.float32), sample.mean(axis=0).astype(np.float32))

    @property
    def words(self) -> int:
        return self.signs.shape[1] // 64

    def encode(self, vectors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Codes [n, W] uint64 and factors [n] float32 for unit rows `vectors` [n, dim]."""
        codes = np.zeros((len(vectors), self.words), np.uint64)
        factors = np.zeros(len(vectors), np.float32)
        encode_rows(np.ascontiguousarray(vectors, np.float32), self.centroid, self.signs, codes, factors)
        return codes, factors


ROUNDS = 2


@njit(cache=True, fastmath=True, nogil=True)
def rotate(x, signs):
    """Apply the rotation to x [Dp] in place."""
    n = x.shape[0]
    scale = np.float32(1.0 / np.sqrt(n))
    for r in range(signs.shape[0]):
        for i in range(n):
            x[i] *= signs[r, i]
        _fwht8(x)
        h = 8
        while h < n:  # the wide stages: contiguous runs of h, which vectorise
            for i in range(0, n, 2 * h):
                for j in range(i, i + h):
                    a = x[j]
                    b = x[j + h]
                    x[j] = a + b
                    x[j + h] = a - b
            h *= 2
        for i in range(n):
            x[i] *= scale


@njit(cache=True, fastmath=True, nogil=True, inline="always")
def _fwht8(x):
    """The first three Hadamard stages (h = 1, 2, 4) on each block of 8, in registers."""
    for i in range(0, x.shape[0], 8):
        a0 = x[i] + x[i + 1]
        a1 = x[i] - x[i + 1]
        a2 = x[i + 2] + x[i + 3]
        a3 = x[i + 2] - x[i + 3]
        a4 = x[i + 4] + x[i + 5]
        a5 = x[i + 4] - x[i + 5]
        a6 = x[i + 6] + x[i + 7]
        a7 = x[i + 6] - x[i + 7]
        b0, b1, b2, b3 = a0 + a2, a1 + a3, a0 - a2, a1 - a3
        b4, b5, b6, b7 = a4 + a6, a5 + a7, a4 - a6, a5 - a7
        x[i], x[i + 1], x[i + 2], x[i + 3] = b0 + b4, b1 + b5, b2 + b6, b3 + b7
        x[i + 4], x[i + 5], x[i + 6], x[i + 7] = b0 - b4, b1 - b5, b2 - b6, b3 - b7


@njit(cache=True, fastmath=True, nogil=True)
def encode_rows(rows, centroid, signs, codes, factors):
    """Sign bits of the rotated residual into codes [n, W]; |r| / sum|x_unit| into factors [n]."""
    dim = rows.shape[1]
    x = np.empty(signs.shape[1], np.float32)  # [Dp]
    for i in range(rows.shape[0]):
        x[:] = 0
        norm2 = np.float32(0.0)
        for j in range(dim):
            x[j] = rows[i, j] - centroid[j]
            norm2 += x[j] * x[j]
        rotate(x, signs)
        l1 = np.float32(0.0)
        for j in range(x.shape[0]):
            l1 += abs(x[j])
            if x[j] > 0:
                codes[i, j >> 6] |= np.uint64(1) << np.uint64(j & 63)
        factors[i] = norm2 / l1 if l1 > 0 else np.float32(0.0)  # |r|^2 / |x|_1 = |r| / |x_unit|_1


@njit(cache=True, fastmath=True, nogil=True)
def prepare_query(signs, q, qbits):
    """Rotate q [dim] and round it to 4-bit planes qbits [4, W]; returns (low, step, total)."""
    dp = signs.shape[1]
    qr = np.zeros(dp, np.float32)  # [Dp]
    qr[: q.shape[0]] = q
    rotate(qr, signs)
    low = qr.min()
    step = (qr.max() - low) / np.float32(2**QUERY_BITS - 1)
    if step <= 0:
        step = np.float32(1.0)
    inv = np.float32(1.0) / step
    total = np.int64(0)
    for w in range(dp // 64):  # branch-free: each plane word gathers its 64 bits in a register
        p0 = p1 = p2 = p3 = np.uint64(0)
        for b in range(64):
            u = np.uint64(np.int64((qr[w * 64 + b] - low) * inv + np.float32(0.5)))
            total += np.int64(u)
            bit = np.uint64(b)
            p0 |= (u & np.uint64(1)) << bit
            p1 |= ((u >> np.uint64(1)) & np.uint64(1)) << bit
            p2 |= ((u >> np.uint64(2)) & np.uint64(1)) << bit
            p3 |= ((u >> np.uint64(3)) & np.uint64(1)) << bit
        qbits[0, w], qbits[1, w], qbits[2, w], qbits[3, w] = p0, p1, p2, p3
    return low, step, low * dp + step * np.float32(total)


@njit(cache=True, fastmath=True, nogil=True, inline="always")
def estimate(code, factor, qbits, low, step, total):
    """Estimated <o, q> - <c, q> for one code [W] and its factor."""
    weighted = np.int64(0)
    ones = np.int64(0)
    for w in range(code.shape[0]):
        c = code[w]
        ones += popcount(c)
        weighted += (popcount(c & qbits[0, w]) + 2 * popcount(c & qbits[1, w])
                     + 4 * popcount(c & qbits[2, w]) + 8 * popcount(c & qbits[3, w]))
    s_b = step * np.float32(weighted) + low * np.float32(ones)
    return factor * (np.float32(2.0) * s_b - total)
