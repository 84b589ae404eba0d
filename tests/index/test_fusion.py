"""Linear fusion of dense and lexical scores."""

import pytest

from kvmem.index.fusion import linear


def test_scores_are_the_weighted_normalised_sum():
    dense = {"a": 0.9, "b": 0.5, "c": 0.1}
    lexical = {"b": 4.0, "c": 8.0, "z": 2.0}  # z is not a candidate: it is ignored
    hits = linear(dense, lexical, k=3, dense_weight=0.6)
    got = {h.id: h.score for h in hits}
    assert got == pytest.approx({"a": 0.6, "b": 0.6 * 0.5 + 0.4 * 0.5, "c": 0.4})
    assert [h.id for h in hits] == ["a", "b", "c"]
    assert [h.id for h in linear(dense, lexical, 3, dense_weight=1.0)] == ["a", "b", "c"]
    assert [h.id for h in linear(dense, lexical, 3, dense_weight=0.0)] == ["c", "b", "a"]
    assert linear({}, lexical, 3, 0.6) == []


def test_the_best_match_of_either_ranking_is_never_fused_away():
    """A fact that alone holds the query's rare word but is far from it in embedding space."""
    dense = {f"d{i}": 1.0 - i / 100 for i in range(20)} | {"exact": 0.0}
    lexical = {f"d{i}": 1.0 for i in range(20)} | {"exact": 1.2}
    unpinned = sorted(dense, key=lambda i: -(0.6 * dense[i] + 0.4 * lexical[i] / 1.2))
    assert "exact" not in unpinned[:5]  # plain fusion would drop it
    top = [h.id for h in linear(dense, lexical, k=5, dense_weight=0.6)]
    assert "exact" in top and "d0" in top and len(top) == 5
    assert top == sorted(top, key=lambda i: (-(0.6 * dense[i] + 0.4 * lexical[i] / 1.2), i))
    assert [h.id for h in linear(dense, lexical, k=1, dense_weight=0.6)] == ["d0"]
