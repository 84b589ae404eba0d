"""Which fact tokens selective recompute chooses (kv/recompute.py): per fact, but for rule "global"."""

import pytest
import torch

from kvmem.kv.recompute import (Recompute, key_deviation, positional, progressive_count, top_per_fact,
                                top_per_request)


def test_each_fact_recomputes_its_share_and_at_least_one_token():
    rec = Recompute(0.1)
    assert [rec.count(n) for n in (1, 9, 10, 11, 37)] == [1, 1, 1, 2, 4]
    assert Recompute(0.0).count(37) == 0 and Recompute(1.0).count(37) == 37
    assert Recompute(0.0).tag == "off" and Recompute(0.05, "first").tag == "first-0.05"


def test_first_and_last_choose_the_ends_of_each_fact():
    spans = [(10, 10), (20, 5)]
    assert positional(spans, Recompute(0.2, "first")).tolist() == [10, 11, 20]
    assert positional(spans, Recompute(0.2, "last")).tolist() == [18, 19, 24]
    with pytest.raises(ValueError):
        positional(spans, Recompute(0.2, "deviation"))


def test_top_per_fact_never_lets_one_fact_take_anothers_budget():
    scores = torch.tensor([9.0, 8.0, 7.0, 0.1, 0.2, 0.3])  # the first fact scores higher everywhere
    assert top_per_fact(scores, [3, 3], Recompute(0.3)).tolist() == [0, 5]
    assert top_per_fact(scores, [3, 3], Recompute(0.5)).tolist() == [0, 1, 4, 5]
    with pytest.raises(ValueError):
        top_per_fact(scores, [3, 2], Recompute(0.34))


def test_global_spends_one_budget_across_a_requests_facts():
    scores = torch.tensor([9.0, 8.0, 7.0, 0.1, 0.2, 0.3, 5.0, 1.0])  # two requests: 6 tokens, then 2
    assert top_per_request(scores, [6, 2], Recompute(0.3)).tolist() == [0, 1, 6]  # the first fact takes both
    assert top_per_fact(scores, [3, 3, 2], Recompute(0.3)).tolist() == [0, 5, 6]


def test_progressive_counts_fall_across_layers_and_average_the_fraction():
    rec, layers, n = Recompute(0.2), 30, 200
    counts = [progressive_count(n, rec, i, layers) for i in range(1, layers)]
    assert counts[0] == 60 and counts[-1] == 20 and counts == sorted(counts, reverse=True)
    assert abs(sum(counts) / len(counts) - rec.fraction * n) <= 1  # equal budget to deviation's
    assert progressive_count(3, Recompute(0.01), layers - 1, layers) == 1  # never a fact left out
    assert progressive_count(3, Recompute(1.0), 1, layers) == 3  # never more than the fact


def test_deviation_is_per_token_over_heads_and_dims():
    fresh = torch.zeros(3, 2, 4)
    injected = fresh.clone()
    injected[1, 1, 2] = 3.0
    assert key_deviation(fresh, injected).tolist() == [0.0, 3.0, 0.0]


@pytest.mark.parametrize("bad", [(-0.1, "first"), (1.5, "first"), (True, "first"), (0.1, "oracles")])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError, match="recompute"):
        Recompute(*bad)
