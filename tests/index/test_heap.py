"""The compiled selections against numpy: k_best, at_cut, scatter_add."""

import numpy as np
import pytest

from kvmem.index.heap import at_cut, k_best, scatter_add


@pytest.mark.parametrize("n,k", [(1, 1), (10, 3), (10, 10), (1000, 50), (1000, 999)])
def test_k_best_and_the_cut_agree_with_a_sort(n, k):
    rng = np.random.default_rng(n * 7 + k)
    values = rng.integers(0, 20, n).astype(np.float64)  # few distinct values: ties at the cut
    best = k_best(values, k)
    assert len(best) == len(set(best.tolist())) == k
    kth = np.sort(values)[::-1][k - 1]
    assert np.sort(values[best])[::-1].tolist() == np.sort(values)[::-1][:k].tolist()
    above, tied = at_cut(values, k)
    assert above.tolist() == np.flatnonzero(values > kth).tolist()
    assert tied.tolist() == np.flatnonzero(values == kth).tolist()
    assert len(above) < k <= len(above) + len(tied)


def test_scatter_add_is_fancy_index_add_for_distinct_rows():
    rng = np.random.default_rng(1)
    out, want = np.zeros(100), np.zeros(100)
    for _ in range(5):
        rows = rng.choice(100, 30, replace=False)
        values = rng.random(30)
        scatter_add(out, rows, values)
        want[rows] += values
    assert out.tolist() == pytest.approx(want.tolist())
