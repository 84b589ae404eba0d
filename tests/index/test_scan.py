"""The int8-first scan against the plain float32 scan: the same exact top-k, through writes."""

import numpy as np
import pytest

from kvmem.index.exact import ExactIndex
from kvmem.index.scan import int8_scores


def ranked(index, q, k):
    return [(h.id, h.score) for h in index.search("u", q, k)]


def assert_same(scan, plain, q, k):
    """The same scores rank by rank, each hit truly scoring what it says. Ids may differ only
    among scores equal to float32 rounding: a gathered row's product can round differently
    from the same row's in a whole-block product."""
    got, want = ranked(scan, q, k), ranked(plain, q, k)
    every = dict(ranked(plain, q, 10**6))
    assert [s for _, s in got] == pytest.approx([s for _, s in want], abs=1e-6)
    assert [every[i] for i, _ in got] == pytest.approx([s for _, s in got], abs=1e-6)
    assert len({i for i, _ in got}) == len(got)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_int8_first_scan_equals_the_float32_scan_through_writes(seed):
    """Near-duplicate clusters make the int8 order differ from the exact one at the cut; exact
    duplicates make ties that the id must break."""
    rng = np.random.default_rng(seed)
    dim = 48
    scan, plain = ExactIndex(dim, scan_from=1), ExactIndex(dim, scan_from=10**9)
    centres = rng.normal(size=(4, dim)).astype(np.float32)
    live: list[str] = []
    for step in range(30):
        n = int(rng.integers(1, 60))
        rows = centres[rng.integers(0, 4, n)] + 0.003 * rng.normal(size=(n, dim)).astype(np.float32)
        rows[: n // 4] = rows[0]  # exact duplicates: equal scores
        ids = [f"f{rng.integers(0, 400)}" for _ in range(n)]  # some re-adds replace rows
        for index in (scan, plain):
            index.add("u", ids, rows)
        live = sorted(set(live) | set(ids))
        for victim in rng.choice(live, size=min(len(live), int(rng.integers(0, 15))), replace=False):
            assert scan.remove("u", str(victim)) == plain.remove("u", str(victim))
        live = [i for i in live if scan.count("u") and i in {h.id for h in plain.search("u", rows[0], 10**6)}]
        q = centres[rng.integers(0, 4)] + 0.003 * rng.normal(size=dim).astype(np.float32)
        for k in (1, 5, 20, 100):
            assert_same(scan, plain, q, k)


def test_the_bound_is_needed_where_int8_reorders():
    """The int8 approximation alone picks a different top 10 here; the scan still returns the exact one."""
    rng = np.random.default_rng(7)
    dim, n = 64, 3000
    rows = rng.normal(size=dim).astype(np.float32) + 0.01 * rng.normal(size=(n, dim)).astype(np.float32)
    rows /= np.linalg.norm(rows, axis=1, keepdims=True)
    q = rows[0] + 0.01 * rng.normal(size=dim).astype(np.float32)
    q /= np.linalg.norm(q)
    peak = np.abs(rows).max(axis=1)
    codes = np.rint(rows / (peak / 127)[:, None]).astype(np.int8)
    approx, _ = int8_scores(codes, (peak / 127).astype(np.float32), q, 10)
    assert set(np.argsort(-approx)[:10]) != set(np.argsort(-(rows @ q))[:10])
    scan, plain = ExactIndex(dim, scan_from=1), ExactIndex(dim, scan_from=10**9)
    ids = [f"r{i:04d}" for i in range(n)]
    for index in (scan, plain):
        index.add("u", ids, rows)
    assert_same(scan, plain, q, 10)


@pytest.mark.parametrize("n,k", [(1, 1), (5, 10), (300, 1), (300, 7), (3000, 100), (3000, 3000)])
def test_the_scans_heap_keeps_the_k_best_approximate_scores(n, k):
    """The rows the scoring loop's heap keeps are the k best by the approximate scores it
    returns (the floor of the exact search is taken over them)."""
    rng = np.random.default_rng(n + k)
    rows = rng.normal(size=(n, 32)).astype(np.float32)
    rows[n // 2:] = rows[: n - n // 2]  # duplicates: equal scores across the cut
    peak = np.abs(rows).max(axis=1)
    codes = np.rint(rows / (peak / 127)[:, None]).astype(np.int8)
    approx, best = int8_scores(codes, (peak / 127).astype(np.float32), rng.normal(size=32).astype(np.float32), k)
    assert len(best) == len(set(best.tolist())) == min(k, n)
    assert np.sort(approx[best])[::-1] == pytest.approx(np.sort(approx)[::-1][: min(k, n)], abs=0)


def test_row_scores_read_in_place_equal_the_gathered_product():
    from kvmem.index.scan import row_scores

    rng = np.random.default_rng(3)
    vectors = rng.normal(size=(500, 48)).astype(np.float32)
    q = rng.normal(size=48).astype(np.float32)
    for rows in (np.array([], np.int64), np.array([7]), rng.choice(500, 120, replace=False), np.array([3, 3, 499])):
        assert row_scores(vectors, rows, q) == pytest.approx(vectors[rows] @ q, abs=1e-4)
