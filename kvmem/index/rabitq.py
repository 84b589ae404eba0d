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
from numba import njit, types
from numba.extending import intrinsic

QUERY_BITS = 4


@intrinsic
def popcount(typingctx, x):
    """The CPU's popcnt on one 64-bit word (numba has no builtin for it)."""
    if not isinstance(x, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        return builder.ctpop(args[0])

    return x(x), codegen


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
        h = 1
        while h < n:
            for i in range(0, n, 2 * h):
                for j in range(i, i + h):
                    a = x[j]
                    b = x[j + h]
                    x[j] = a + b
                    x[j + h] = a - b
            h *= 2
        for i in range(n):
            x[i] *= scale


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
    qbits[:] = 0
    total = np.float32(0.0)
    for i in range(dp):
        u = np.int64((qr[i] - low) / step + np.float32(0.5))
        total += np.float32(u)
        word, bit = i >> 6, np.uint64(i & 63)
        for plane in range(QUERY_BITS):
            if (u >> plane) & 1:
                qbits[plane, word] |= np.uint64(1) << bit
    return low, step, low * dp + step * total


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
