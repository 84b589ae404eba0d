"""Selective recompute in the lab: the oracles it must meet before its sweep means anything."""

from __future__ import annotations

import pytest
import torch

from kvmem.kv.recompute import Recompute
from kvmem.tune.blend import blend, fact_spans, text_cache
from kvmem.tune.lab import memory_cache, reply_logits
from tests.conftest import FACTS


@pytest.mark.parametrize("rule", ["first", "last", "deviation", "oracle"])
@torch.no_grad()
def test_recomputing_every_fact_token_is_text_prefill(hf_model, make_example, rule):
    ex = make_example()
    reply = ex.tail[-3:]  # any tokens: teacher-forced
    text = reply_logits(hf_model, ex, reply)
    kv = memory_cache(hf_model, ex)
    full = blend(hf_model, ex, kv, Recompute(1.0, rule), text_layers=text_cache(hf_model, ex))
    assert full.recomputed == sum(n for _, n in fact_spans(ex))
    gap = (reply_logits(hf_model, ex, reply, full.layers) - text).abs().max()
    assert gap < 2e-3, gap
    plain_gap = (reply_logits(hf_model, ex, reply, kv) - text).abs().max()
    assert plain_gap > 50 * gap  # the oracle is not met by KV mode itself


@torch.no_grad()
def test_recomputing_nothing_is_kv_mode_bit_for_bit(hf_model, make_example):
    ex = make_example()
    kv = memory_cache(hf_model, ex)
    none = blend(hf_model, ex, kv, Recompute(0.0))
    assert none.recomputed == 0
    for (k, v), (k2, v2) in zip(kv, none.layers):
        assert torch.equal(k, k2) and torch.equal(v, v2)


@torch.no_grad()
def test_recomputed_tokens_hold_text_prefills_kv_at_layer_0(hf_model, make_example):
    """Layer 0 sees only the token and its position: a recomputed token's layer-0 KV is text
    prefill's, and every other token keeps its injected KV."""
    ex = make_example()
    kv = memory_cache(hf_model, ex)
    text = text_cache(hf_model, ex)
    out = blend(hf_model, ex, kv, Recompute(0.25, "last"))
    start, n = fact_spans(ex)[1]
    chosen = Recompute(0.25, "last").count(n)
    k0, kv0, t0 = out.layers[0][0][0], kv[0][0][0], text[0][0][0]  # [H, M, d]
    torch.testing.assert_close(k0[:, start + n - chosen : start + n], t0[:, start + n - chosen : start + n],
                               rtol=1e-4, atol=1e-4)
    assert torch.equal(k0[:, start : start + n - chosen], kv0[:, start : start + n - chosen])
    assert out.recomputed == sum(Recompute(0.25).count(n) for _, n in fact_spans(ex))


@torch.no_grad()
def test_a_tenth_recomputed_moves_kv_mode_toward_text(hf_model, make_example):
    ex = make_example()
    reply = ex.tail[-3:]
    text = reply_logits(hf_model, ex, reply).log_softmax(-1)
    kv = memory_cache(hf_model, ex)

    def kl(layers):
        student = reply_logits(hf_model, ex, reply, layers).log_softmax(-1)
        return (text.exp() * (text - student)).sum(-1).mean().item()

    assert kl(blend(hf_model, ex, kv, Recompute(0.5, "deviation")).layers) < kl(kv)


def test_several_facts_select_per_fact(make_example):
    ex = make_example(FACTS[:3])
    spans = fact_spans(ex)
    assert [s for s, _ in spans] == [len(ex.head) + sum(len(f) for _, f in ex.facts[:i]) for i in range(3)]
