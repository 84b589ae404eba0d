"""The reader's KV map: it commutes with RoPE (so it can act on keys already rotated), the file
round-trips, bad files are refused (and with them the adapter), and the lab maps exactly the
facts' tokens."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from kvmem.errors import AdapterError
from kvmem.reader import adapters, kvmap, lora


def random_map(layers=2, heads=3, dim=8, seed=0, spread=0.3, rotary_dim=None) -> kvmap.KVMap:
    g = torch.Generator().manual_seed(seed)
    half, full = (layers, heads, dim // 2), (layers, heads, dim)
    return kvmap.KVMap(1 + spread * torch.randn(half, generator=g), spread * torch.randn(half, generator=g),
                       1 + spread * torch.randn(full, generator=g), spread * torch.randn(full, generator=g),
                       rotary_dim=rotary_dim)


def tiny_hf(kind: str):
    """A one- or two-layer Hugging Face model whose rotary is not the bundled model's: "per-layer"
    (Gemma 3: a sliding layer with base 10k beside a global one with 1M), "partial" (Phi-3 with
    half its head rotated)."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig, Phi3Config

    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=64, num_attention_heads=2,
                  num_key_value_heads=2)
    if kind == "per-layer":
        cfg = Gemma3TextConfig(**common, head_dim=32, num_hidden_layers=2, sliding_window=8,
                               layer_types=["sliding_attention", "full_attention"],
                               rope_theta=1_000_000.0, rope_local_base_freq=10_000.0)
    else:
        cfg = Phi3Config(**common, num_hidden_layers=1, partial_rotary_factor=0.5, pad_token_id=0)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


@pytest.mark.parametrize("kind", ["per-layer", "partial"])
def test_the_key_map_commutes_with_each_layers_rope(kind):
    """Oracle: as for the bundled model, on every layer of a model with per-layer bases and of
    one with partial rotary (the map pairs the rotated dims and the rest apart)."""
    from kvmem.tune.lab import move_keys, rotary_dim

    model = tiny_hf(kind)
    c, head = model.config, 32
    r = rotary_dim(model)
    assert r == (16 if kind == "partial" else 32)
    m = random_map(c.num_hidden_layers, c.num_key_value_heads, head, rotary_dim=r)
    pre = torch.randn(1, c.num_key_value_heads, 5, head)  # [1, H, n, D]
    delta = torch.tensor([[0, 7, 100, 3000, 12]])
    for layer in range(c.num_hidden_layers):
        a = m.keys(layer, move_keys(model, pre, delta, layer))
        b = move_keys(model, m.keys(layer, pre), delta, layer)
        assert torch.allclose(a, b, atol=1e-4)
    if kind == "per-layer":  # the two layers really rotate apart, so the per-layer table matters
        assert not torch.allclose(move_keys(model, pre, delta, 0), move_keys(model, pre, delta, 1), atol=1e-2)
    else:  # the resting dims do not move, and a map pairing the whole head would not commute
        assert torch.equal(move_keys(model, pre, delta)[..., r:], pre[..., r:])
        whole = random_map(1, c.num_key_value_heads, head)
        a, b = whole.keys(0, move_keys(model, pre, delta)), move_keys(model, whole.keys(0, pre), delta)
        assert not torch.allclose(a, b, atol=1e-2)


def test_the_key_map_commutes_with_rope(hf_model):
    """Mapping keys rotated to position p equals rotating mapped pre-RoPE keys to p: one map
    serves a fact wherever it is injected."""
    from kvmem.tune.lab import move_keys

    c = hf_model.config
    m = random_map(c.num_hidden_layers, c.num_key_value_heads, c.hidden_size // c.num_attention_heads)
    pre = torch.randn(1, c.num_key_value_heads, 5, c.hidden_size // c.num_attention_heads)  # [1, H, n, D]
    delta = torch.tensor([[0, 7, 100, 3000, 12]])
    a = m.keys(3, move_keys(hf_model, pre, delta))
    b = move_keys(hf_model, m.keys(3, pre), delta)
    assert torch.allclose(a, b, atol=1e-5) and not torch.allclose(a, move_keys(hf_model, pre, delta), atol=1e-2)


def test_identity_changes_nothing():
    k, v = torch.randn(1, 3, 4, 8), torch.randn(1, 3, 4, 8)
    m = kvmap.KVMap.identity(2, 3, 8)
    assert torch.equal(m.keys(1, k), k) and torch.equal(m.values(1, v), v)


@pytest.mark.parametrize("rotary_dim", [None, 4])
def test_save_load_round_trip(tmp_path, rotary_dim):
    m = random_map(rotary_dim=rotary_dim)
    kvmap.save(tmp_path, m)
    got = kvmap.load(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(got.tensors(), m.tensors())) and got.rotary_dim == rotary_dim
    assert kvmap.load(tmp_path / "nowhere") is None and kvmap.load(None) is None
    got.check_shape(2, 3, 8)
    with pytest.raises(AdapterError, match=r"\[2, 3, 8\], the model has \[2, 2, 8\]"):
        got.check_shape(2, 2, 8)


def _bad(name):
    m = random_map()
    t = dict(zip(kvmap.NAMES, m.tensors()))
    if name == "nan":
        t["key_b"][0, 0, 0] = float("nan")
    elif name == "shape":
        t["key_a"] = torch.ones(2, 3, 8)
    elif name == "missing":
        del t["value_shift"]
    return t


@pytest.mark.parametrize("case, match", [("nan", "key_b must be finite"), ("shape", "head_dim / 2"),
                                         ("missing", "a KV map holds tensors"), ("odd rotary", "rotary_dim 3"),
                                         ("rotary beyond", "rotary_dim 10")])
def test_malformed_maps_are_refused(tmp_path, case, match):
    from safetensors.torch import save_file

    metadata = {"odd rotary": {"rotary_dim": "3"}, "rotary beyond": {"rotary_dim": "10"}}.get(case)
    tensors = _bad(case) if case in ("nan", "shape", "missing") else dict(zip(kvmap.NAMES, random_map().tensors()))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / kvmap.FILE), metadata=metadata)
    with pytest.raises(AdapterError, match=match):
        kvmap.load(tmp_path)


def test_a_map_only_adapter_is_found_and_a_bad_map_refuses_the_adapter(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(adapters, "SHIPPED", tmp_path / "shipped")
    fp = "c" * 64
    folder = adapters.user_folder(tmp_path, fp)
    lora.save([], folder, rank=8, alpha=16.0, base_model="", meta={"fingerprint": fp}, kv_map=random_map())
    assert not lora.has_lora(folder)  # no PEFT files: vLLM runs no LoRA for it
    assert adapters.find("auto", tmp_path, fp) == folder
    (folder / kvmap.FILE).write_bytes(b"not safetensors")
    with caplog.at_level(logging.WARNING, logger="kvmem.reader.adapters"):
        assert adapters.find("auto", tmp_path, fp) is None
    assert "refused, plain KV mode" in caplog.text and "kv_map.safetensors is unreadable" in caplog.text
    (folder / kvmap.FILE).unlink()  # neither a LoRA nor a map left
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvmem.reader.adapters"):
        assert adapters.find("auto", tmp_path, fp) is None
    assert "adapter_config.json is missing" in caplog.text
    with pytest.raises(AdapterError, match="a LoRA, a KV map or both"):
        lora.save([], tmp_path / "empty", rank=8, alpha=16.0, base_model="", meta={})
    json.loads((folder / lora.META).read_text())  # kvmem.json left as written


def test_lab_maps_only_the_span():
    g = torch.Generator().manual_seed(0)
    layers = [(torch.randn(1, 3, 10, 8, generator=g), torch.randn(1, 3, 10, 8, generator=g)) for _ in range(2)]
    m = random_map()
    out = kvmap.apply(layers, 4, 9, m)
    for i, ((k, v), (mk, mv)) in enumerate(zip(layers, out)):
        for part, got in ((k, mk), (v, mv)):
            assert torch.equal(got[:, :, :4], part[:, :, :4]) and torch.equal(got[:, :, 9:], part[:, :, 9:])
        assert torch.allclose(mk[:, :, 4:9], m.keys(i, k[:, :, 4:9]))
        assert torch.allclose(mv[:, :, 4:9], m.values(i, v[:, :, 4:9]))
        assert not torch.allclose(mk[:, :, 4:9], k[:, :, 4:9])
