"""`kvmem tune-reader`'s loop: the distillation loss falls on a tiny run, and the adapter it saves loads."""

from __future__ import annotations

import pytest
import torch

from kvmem.reader import kvmap, lora
from kvmem.tune.train import TuneConfig, load_model, tune
from tests.conftest import FACTS


def _examples(make_example):
    return [make_example(FACTS, "What is my sister's puppy called?"),
            make_example(FACTS[::-1], "Which instrument do I play?")]


def _falls(losses) -> bool:
    return sum(losses[-2:]) / 2 < 0.7 * sum(losses[:2]) / 2


def test_loss_falls_and_the_kv_map_is_saved(model_dir, make_example, eos, tmp_path):
    """The default: a KV map alone, no LoRA."""
    examples = _examples(make_example)
    model = load_model(model_dir)
    out = tmp_path / "adapter"
    cfg = TuneConfig(epochs=5, reply_tokens=6, checkpoint_every=3, map_lr=1e-2)
    report = tune(model, examples, eos, out, cfg, {"fingerprint": "f" * 64}, progress=False)
    losses = lora.read_meta(out)["losses"]
    assert report.steps == len(losses) == 10 and _falls(losses), losses
    assert not (tmp_path / "adapter.work").exists()  # work (teacher targets, checkpoint) removed on success
    assert not lora.has_lora(out)
    trained = kvmap.load(out)
    c = model.config
    trained.check_shape(c.num_hidden_layers, c.num_key_value_heads, c.hidden_size // c.num_attention_heads)
    identity = kvmap.KVMap.identity(*trained.shape)
    assert all((a - b).abs().max() > 1e-3 for a, b in zip(trained.tensors(), identity.tensors()))


def test_loss_falls_and_a_lora_alone_is_saved(model_dir, make_example, eos, tmp_path):
    examples = _examples(make_example)
    model = load_model(model_dir)
    out = tmp_path / "adapter"
    cfg = TuneConfig(rank=4, lr=1e-3, epochs=5, reply_tokens=6, checkpoint_every=3, targets=("q_proj",), kv_map=False)
    tune(model, examples, eos, out, cfg, {"fingerprint": "f" * 64}, progress=False)
    losses = lora.read_meta(out)["losses"]
    assert len(losses) == 10 and _falls(losses), losses
    assert kvmap.load(out) is None
    fresh = load_model(model_dir)
    wrapped = lora.attach(fresh, rank=4, alpha=cfg.alpha)
    lora.load_into(wrapped, out)
    assert all(m.lora_B.abs().max() > 0 for _, m in wrapped)
    ids = torch.tensor([examples[0].ids])
    with torch.no_grad():
        assert torch.allclose(fresh(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5)


def test_reply_loss_weights_the_first_token():
    from kvmem.tune.train import reply_loss

    kl = torch.tensor([1.0, 0.0, 0.0, 0.0])
    assert reply_loss(kl).item() == 0.25  # weight 1: the plain mean
    assert abs(reply_loss(kl, 4.0).item() - 4 / 7) < 1e-7
    assert abs(reply_loss(torch.tensor([0.0, 1.0, 1.0, 1.0]), 4.0).item() - 3 / 7) < 1e-7


def test_alpha_must_be_positive():
    with pytest.raises(ValueError, match="alpha"):
        TuneConfig(alpha=0.0)


def test_first_weight_must_be_positive():
    with pytest.raises(ValueError, match="first_weight"):
        TuneConfig(first_weight=0.0)


def test_nothing_to_train_is_refused():
    with pytest.raises(ValueError, match="nothing to train"):
        TuneConfig(targets=(), kv_map=False)
