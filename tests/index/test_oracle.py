"""ExactIndex against a brute-force oracle over a long random mix of adds, replaces and removes."""

from __future__ import annotations

import numpy as np
import pytest

from kvmem.index import ExactIndex

DIM = 16
SCOPES = ["alice", "bob", "carol"]
TOL = 1e-5  # float32 index vs float64 oracle

# Each filter comes with a plain-python predicate written independently of kvmem's filters.
FILTERS = [
    (None, lambda m: True),
    ({"g": 1}, lambda m: m["g"] == 1),
    ({"g": {"in": [0, 2]}}, lambda m: m["g"] in (0, 2)),
    ({"g": {"ne": 3}, "t": {"lt": 0.5}}, lambda m: m["g"] != 3 and m["t"] < 0.5),
    ({"t": {"gte": 0.3, "lte": 0.8}}, lambda m: 0.3 <= m["t"] <= 0.8),
    ({"d": {"gte": "2024-06-01"}}, lambda m: m["d"] >= "2024-06-01"),  # ISO dates sort as text
    (
        {"g": {"nin": [1, 2]}, "d": {"lt": "2024-03-15T00:00:00"}},
        lambda m: m["g"] not in (1, 2) and m["d"] < "2024-03-15",
    ),
]


def random_meta(rng: np.random.Generator) -> dict:
    day = f"2024-{rng.integers(1, 13):02d}-{rng.integers(1, 29):02d}"
    return {"g": int(rng.integers(0, 4)), "t": float(rng.random()), "d": day}


def oracle_top(ref: dict, query: np.ndarray, k: int, pred) -> list[tuple[float, str]]:
    """Best k as (score, id), float64, best first, ties by id."""
    q = query / np.linalg.norm(query)
    scored = [(float(vec @ q), id_) for id_, (vec, meta) in ref.items() if pred(meta)]
    return sorted(scored, key=lambda p: (-p[0], p[1]))[:k]


def check_search(ix: ExactIndex, ref: dict, scope: str, query: np.ndarray, k: int, filt, pred) -> None:
    hits = ix.search(scope, query, k, filt)
    want = oracle_top(ref, query, k + 1, pred)
    near_tie = any(abs(a[0] - b[0]) < TOL for a, b in zip(want, want[1:]))
    want = want[:k]
    assert len(hits) == len(want)
    np.testing.assert_allclose([h.score for h in hits], [s for s, _ in want], atol=TOL)
    assert len({h.id for h in hits}) == len(hits)
    q = query / np.linalg.norm(query)
    for h in hits:  # every hit is a live, matching id with its true score
        vec, meta = ref[h.id]
        assert pred(meta) and h.score == pytest.approx(float(vec @ q), abs=TOL)
    if not near_tie:
        assert [h.id for h in hits] == [i for _, i in want]


def check_no_trace(ix: ExactIndex, refs: dict) -> None:
    """Everything live is findable, nothing removed is, counts agree; internal rows are dense."""
    assert len(ix) == sum(len(r) for r in refs.values())
    for scope in SCOPES:
        ref = refs[scope]
        assert ix.count(scope) == len(ref)
        everything = ix.search(scope, np.ones(DIM), max(1, len(ref) + 5))
        assert sorted(h.id for h in everything) == sorted(ref)
        for id_, (vec, _) in ref.items():
            hits = ix.search(scope, vec, len(ref))  # k covers any rows with the same direction
            assert hits[0].score == pytest.approx(1.0, abs=TOL)
            assert id_ in [h.id for h in hits if h.score > 1 - TOL]
        block = ix._scopes.get(scope)  # white-box: the swap-delete bookkeeping itself
        if block is not None:
            assert block.rows == {id_: i for i, id_ in enumerate(block.ids)}
            assert len(block.metas) == len(block.ids) <= len(block.vectors)
            for id_, row in block.rows.items():
                np.testing.assert_allclose(block.vectors[row], ref[id_][0], atol=1e-6)
                assert block.metas[row] == ref[id_][1]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_ops_match_oracle(seed):
    rng = np.random.default_rng(seed)
    ix = ExactIndex(DIM)
    refs: dict[str, dict[str, tuple[np.ndarray, dict]]] = {s: {} for s in SCOPES}
    pool = [f"id{i:03d}" for i in range(250)]
    for step in range(400):
        scope = SCOPES[rng.integers(len(SCOPES))]
        ref = refs[scope]
        r = rng.random()
        if r < 0.55:  # add a batch: fresh ids, existing ids (replace) and sometimes a duplicate vector
            ids = list(rng.choice(pool, size=int(rng.integers(1, 12)), replace=False))
            vecs = rng.normal(size=(len(ids), DIM))
            if ref and rng.random() < 0.2:
                vecs[0] = ref[sorted(ref)[0]][0] * 3.0  # same direction as a live row: an exact tie
            metas = [random_meta(rng) for _ in ids]
            ix.add(scope, ids, vecs, metas)
            for id_, v, m in zip(ids, vecs, metas):
                ref[id_] = (v / np.linalg.norm(v), m)
        elif r < 0.95:  # remove: usually a live id, sometimes one that is not there
            live = ref and rng.random() < 0.8
            id_ = sorted(ref)[rng.integers(len(ref))] if live else str(rng.choice(pool))
            assert ix.remove(scope, id_) is (ref.pop(id_, None) is not None)
        else:
            assert ix.remove_scope(scope) == len(ref)
            ref.clear()
        if step % 20 == 19:
            for _ in range(10):
                query = rng.normal(size=DIM)
                filt, pred = FILTERS[rng.integers(len(FILTERS))]
                check_search(ix, ref, scope, query, int(rng.integers(1, 15)), filt, pred)
    check_no_trace(ix, refs)
    for scope in SCOPES:  # a last sweep over every filter and several k
        for filt, pred in FILTERS:
            for k in (1, 5, 50):
                check_search(ix, refs[scope], scope, rng.normal(size=DIM), k, filt, pred)
