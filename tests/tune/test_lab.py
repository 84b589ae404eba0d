"""KV mode rebuilt in PyTorch: the oracles it must meet before it can measure or train anything."""

from __future__ import annotations

import pytest
import torch

from kvmem.tune import lab
from kvmem.tune.lab import KVMEM, FactKV, Layout, memory_cache, move_keys, reply_logits
from tests.conftest import FACTS


def test_example_is_the_served_prompt(make_example, prompts):
    ex = make_example()
    assert ex.head == prompts.head_ids
    assert [f for _, f in ex.facts] == prompts.fact_tokens_many(FACTS)
    assert ex.ids[len(ex.memory_ids):] == ex.tail and len(ex.tail) > 0


@torch.no_grad()
def test_one_fact_in_kv_mode_is_text_prefill(hf_model, make_example):
    """k=1, no context: the fact sits where it was encoded, so KV mode must equal text prefill."""
    ex = make_example(FACTS[:1])
    reply = (ex.tail[-1], ex.tail[-2], ex.tail[-3])  # any tokens: teacher-forced
    text = reply_logits(hf_model, ex, reply)
    kv = reply_logits(hf_model, ex, reply, memory_cache(hf_model, ex))
    assert torch.allclose(text, kv, atol=1e-3), (text - kv).abs().max()


@pytest.mark.parametrize("kind", ["per-layer", "partial"])
@torch.no_grad()
def test_kv_mode_is_text_prefill_where_facts_sit_where_encoded_on_other_rotaries(kind, make_example):
    """Oracle for the lab on Gemma 3 (per-layer bases, a window of 8, shorter than the prompt)
    and partial-rotary shapes: k=1 as above, and three facts moved to their serving positions
    give layer 0 the keys a forward computes there."""
    from tests.reader.test_kvmap import tiny_hf

    model = tiny_hf(kind)
    ex = make_example(FACTS[:1])
    reply = (ex.tail[-1], ex.tail[-2], ex.tail[-3])
    text = reply_logits(model, ex, reply)
    kv = reply_logits(model, ex, reply, memory_cache(model, ex))
    assert torch.allclose(text, kv, atol=1e-3), (text - kv).abs().max()
    ex = make_example(FACTS[:3])
    moved, there = (memory_cache(model, ex, layout)[0][0] for layout in (KVMEM, Layout("head", moved=False)))
    assert moved.shape[2] == len(ex.memory_ids) and torch.allclose(moved, there, atol=1e-4)


@torch.no_grad()
def test_moved_keys_equal_keys_encoded_there(hf_model, make_example):
    """Layer 0's keys depend on the token and its position only: a fact encoded after the head and
    moved must have exactly the keys of the same fact encoded at its serving position."""
    ex = make_example(FACTS[:3])
    moved = memory_cache(hf_model, ex, KVMEM)[0][0]
    there = memory_cache(hf_model, ex, Layout("head", moved=False))[0][0]
    assert moved.shape == there.shape == (1, hf_model.config.num_key_value_heads, len(ex.memory_ids),
                                          hf_model.config.head_dim)
    assert torch.allclose(moved, there, atol=1e-4), (moved - there).abs().max()


@torch.no_grad()
def test_move_there_and_back_is_identity(hf_model):
    keys = torch.randn(1, 3, 5, hf_model.config.head_dim)
    delta = torch.tensor([[7, 0, 130, 1, 4000]])
    back = move_keys(hf_model, move_keys(hf_model, keys, delta), -delta)
    assert torch.allclose(keys, back, atol=1e-4)


@torch.no_grad()
def test_remembered_facts_give_the_same_cache(hf_model, make_example):
    facts = FactKV()
    first = make_example(FACTS[:2])
    memory_cache(hf_model, first, facts=facts)  # fills the memory for FACTS[0], FACTS[1]
    ex = make_example(FACTS[1:4])  # FACTS[1] now served at another position
    fresh = memory_cache(hf_model, ex)
    remembered = memory_cache(hf_model, ex, facts=facts)
    # Remembered facts were encoded in a padded batch of another width, and on CPUs whose matmuls
    # block by shape (AMX, oneDNN) that moves float32 results by ~1e-5 at magnitudes ~10: equal up
    # to rounding, not bit for bit. A wrong position or a wrong fact differs by whole units.
    for (k1, v1), (k2, v2) in zip(fresh, remembered):
        torch.testing.assert_close(k2, k1, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(v2, v1, rtol=1e-5, atol=1e-4)


@torch.no_grad()
def test_several_facts_read_apart_differ_from_text(hf_model, make_example):
    """The gap the reader adapter exists for: with 4 independently encoded facts, KV mode is not text."""
    ex = make_example()
    reply = ex.tail[-3:]
    text = reply_logits(hf_model, ex, reply)
    kv = reply_logits(hf_model, ex, reply, memory_cache(hf_model, ex))
    assert (text - kv).abs().max() > 1e-2


def _tiny(config_cls, **extra):
    from transformers import AutoModelForCausalLM

    cfg = config_cls(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=2, **extra)
    return AutoModelForCausalLM.from_config(cfg)


def test_the_bundled_model_has_a_rotary_the_lab_can_move(hf_model):
    lab.check_rotary(hf_model)


def test_an_interleaved_rotary_is_refused_before_training(make_example, eos, tmp_path):
    """tune-reader used to train such a model (or crash mid-run) and leave a map that serving
    then refused: the map's pairs are neox-style."""
    from transformers import CohereConfig

    from kvmem.errors import UnsupportedConfigError
    from kvmem.tune.train import TuneConfig, tune

    with pytest.raises(UnsupportedConfigError, match="interleaved"):
        tune(_tiny(CohereConfig), [make_example()], eos, tmp_path / "adapter", TuneConfig(), {})
    assert not (tmp_path / "adapter").exists()


@pytest.mark.parametrize("kind, rotary_dim", [("per-layer", None), ("partial", 16)])
def test_per_layer_and_partial_rotary_train_a_map_that_says_its_pairing(kind, rotary_dim, make_example, eos,
                                                                         tmp_path):
    """Gemma 3 and partial-rotary Phi-3 shapes used to be refused here (issue 44): now they train,
    and the map's file names the rotated dims serving must pair as the lab did."""
    from kvmem.reader import kvmap
    from kvmem.tune.train import TuneConfig, tune
    from tests.reader.test_kvmap import tiny_hf

    model = tiny_hf(kind)
    assert lab.check_rotary(model) == (rotary_dim or 32)
    tune(model, [make_example()], eos, tmp_path / "adapter", TuneConfig(), {})
    got = kvmap.load(tmp_path / "adapter")
    assert got.rotary_dim == rotary_dim and got.shape == (model.config.num_hidden_layers, 2, 32)
    assert not torch.equal(got.key_b, torch.zeros_like(got.key_b))  # it trained
