"""TieredIndex: scopes move to the graph above promote_at and back below demote_at, unchanged."""

from __future__ import annotations

import numpy as np
import pytest

from kvmem.index import ExactIndex
from kvmem.index.fusion import hybrid_search
from kvmem.index.graph import GraphIndexConfig
from kvmem.index.lexical import LexicalIndex
from kvmem.index.tiered import TierConfig, TieredIndex

DIM = 64
CONFIG = TierConfig(promote_at=300, demote_at=150, graph=GraphIndexConfig(exact_below=0))


def data(n: int, seed: int = 0) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, DIM)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_promotes_above_threshold_and_demotes_below():
    t, e = TieredIndex(DIM, CONFIG), ExactIndex(DIM)
    x = data(400)
    ids = [f"f{i}" for i in range(400)]
    metas = [{"g": i % 3} for i in range(400)]
    for lo in range(0, 400, 50):
        t.add("big", ids[lo: lo + 50], x[lo: lo + 50], metas[lo: lo + 50])
        e.add("big", ids[lo: lo + 50], x[lo: lo + 50], metas[lo: lo + 50])
        assert (t.tier("big") is t.graph) == (lo + 50 >= 300)
    t.add("small", ids[:10], x[:10])
    assert t.tier("small") is t.exact and len(t) == 410
    q = data(1, seed=5)[0]
    assert [h.id for h in t.search("big", q, 1)] == [h.id for h in e.search("big", q, 1)]
    assert {h.id for h in t.search("big", q, 5, {"g": 1})} <= {f"f{i}" for i in range(1, 400, 3)}
    for i in range(260):
        assert t.remove("big", ids[i])
        e.remove("big", ids[i])
    assert t.tier("big") is t.exact and t.count("big") == 140
    assert t.graph.count("big") == 0  # nothing left behind in the graph tier
    assert [h.id for h in t.search("big", q, 10)] == [h.id for h in e.search("big", q, 10)]


def test_hybrid_search_works_on_a_promoted_scope():
    t = TieredIndex(DIM, CONFIG)
    lex = LexicalIndex()
    x = data(350, seed=1)
    ids = [f"f{i}" for i in range(350)]
    t.add("u", ids, x)
    assert t.tier("u") is t.graph
    lex.add("u", ids, ["penicillin allergy" if i == 7 else f"note number {i}" for i in range(350)])
    hits = hybrid_search(t, lex, "u", x[3], "penicillin", 5)
    assert {"f3", "f7"} <= {h.id for h in hits}  # best dense and best lexical both kept


def test_ranked_is_search_as_columns_in_every_tier_and_path():
    """`ranked` (what fusion reads) against `search`: the same ids and scores, in order, for the
    exact tier's plain and int8-first scans, a filtered search, and the graph tier."""
    t = TieredIndex(DIM, CONFIG)
    scanned = ExactIndex(DIM, scan_from=1)
    x = data(350, seed=2)
    ids = [f"f{i}" for i in range(350)]
    metas = [{"g": i % 3} for i in range(350)]
    t.add("small", ids[:100], x[:100], metas[:100])
    t.add("big", ids, x, metas)
    scanned.add("small", ids[:100], x[:100], metas[:100])
    assert t.tier("small") is t.exact and t.tier("big") is t.graph
    q = data(1, seed=9)[0]
    for index, scope, filters in [(t, "small", None), (t, "small", {"g": 2}), (scanned, "small", None),
                                  (t, "big", None), (t, "big", {"g": 1}), (t, "absent", None)]:
        for k in (1, 7, 500):
            ranking, hits = index.ranked(scope, q, k, filters), index.search(scope, q, k, filters)
            assert ranking.ids == [h.id for h in hits] and ranking.hits() == hits
            size = {"small": 100, "big": 350, "absent": 0}[scope]
            assert len(hits) == min(k, size) or (filters and 0 < len(hits) <= size // 3 + 1)


def test_similarities_are_the_cosines_of_the_ids_in_the_scope_in_both_tiers():
    t = TieredIndex(DIM, CONFIG)
    x = data(350, seed=3)
    ids = [f"f{i}" for i in range(350)]
    t.add("small", ids[:50], x[:50])
    t.add("big", ids, x)
    q = data(1, seed=4)[0]
    for scope, size in (("small", 50), ("big", 350)):
        asked = ["f3", "nope", "f40", "f300"]
        got = t.similarities(scope, q, asked)
        want = {i: float(x[int(i[1:])] @ q) for i in asked if i != "nope" and int(i[1:]) < size}
        assert list(got) == list(want) and list(got.values()) == pytest.approx(list(want.values()), abs=2e-3)
    assert t.similarities("small", q, ["nope"]) == {} and t.similarities("absent", q, ["f1"]) == {}
