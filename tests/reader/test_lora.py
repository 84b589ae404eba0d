"""The reader adapter: a no-op when new, queries only, PEFT layout round trip, refused for another model."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from kvmem.reader import adapters, lora


@pytest.fixture()
def adapted(model_dir):
    from kvmem.tune.train import load_model

    model = load_model(model_dir)
    return model, lora.attach(model, rank=4, alpha=8.0)


def _randomize(wrapped) -> None:
    with torch.no_grad():
        for _, m in wrapped:
            m.lora_B.normal_(0, 0.05)


@torch.no_grad()
def test_new_adapter_changes_nothing_and_only_queries_change(adapted):
    model, wrapped = adapted
    ids = torch.tensor([[1, 2, 3, 400, 500, 600, 7]])
    with lora.disabled(wrapped):
        base = model(input_ids=ids, use_cache=True)
    fresh = model(input_ids=ids)
    assert torch.equal(base.logits, fresh.logits)  # B starts at zero
    assert len(wrapped) == model.config.num_hidden_layers
    _randomize(wrapped)
    tuned = model(input_ids=ids, use_cache=True)
    assert (tuned.logits - base.logits).abs().max() > 1e-3
    # Layer 0's keys and values come before any query: the adapter cannot touch them.
    k_base, v_base = base.past_key_values.layers[0].keys, base.past_key_values.layers[0].values
    k_tuned, v_tuned = tuned.past_key_values.layers[0].keys, tuned.past_key_values.layers[0].values
    assert torch.equal(k_base, k_tuned) and torch.equal(v_base, v_tuned)
    assert not torch.equal(base.past_key_values.layers[1].keys, tuned.past_key_values.layers[1].keys)


def test_save_load_round_trip_in_peft_layout(adapted, tmp_path, model_dir):
    from safetensors.torch import load_file

    model, wrapped = adapted
    _randomize(wrapped)
    folder = tmp_path / "adapter"
    lora.save(wrapped, folder, rank=4, alpha=8.0, base_model=str(model_dir), meta={"fingerprint": "abc"})
    config = json.loads((folder / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["target_modules"]) == ("LORA", 4, ["q_proj"])
    names = set(load_file(str(folder / "adapter_model.safetensors")))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in names
    assert len(names) == 2 * model.config.num_hidden_layers
    assert lora.read_meta(folder) == {"fingerprint": "abc"}
    assert lora.lora_rank(folder) == 8  # vLLM's smallest max_lora_rank that holds rank 4
    before = {name: (m.lora_A.clone(), m.lora_B.clone()) for name, m in wrapped}
    with torch.no_grad():
        for _, m in wrapped:
            m.lora_B.zero_()
    lora.load_into(wrapped, folder)
    for name, m in wrapped:
        assert torch.equal(m.lora_A, before[name][0]) and torch.equal(m.lora_B, before[name][1])
    lora.save(wrapped, folder, rank=4, alpha=8.0, base_model="", meta={"fingerprint": "def"})  # replaces
    assert lora.read_meta(folder)["fingerprint"] == "def"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]


def test_an_adapter_on_other_layers_round_trips_with_its_targets(model_dir, tmp_path):
    from kvmem.tune.train import load_model

    model = load_model(model_dir)
    wrapped = lora.attach(model, rank=4, alpha=8.0, targets=("down_proj", "q_proj", "o_proj"))
    assert len(wrapped) == 3 * model.config.num_hidden_layers
    _randomize(wrapped)
    folder = tmp_path / "adapter"
    lora.save(wrapped, folder, rank=4, alpha=8.0, base_model="", meta={"fingerprint": "abc"})
    assert lora.folder_targets(folder) == ["q_proj", "o_proj", "down_proj"]  # PEFT's list, in TARGETS order
    again = lora.attach(load_model(model_dir), rank=4, alpha=8.0, targets=tuple(lora.folder_targets(folder)))
    lora.load_into(again, folder)
    assert [n for n, _ in again] == [n for n, _ in wrapped]
    assert all(torch.equal(a.lora_B, b.lora_B) for (_, a), (_, b) in zip(again, wrapped))


def test_unknown_targets_are_refused(model_dir):
    from kvmem.errors import AdapterError
    from kvmem.tune.train import load_model

    with pytest.raises(AdapterError, match="targets must be among"):
        lora.attach(load_model(model_dir), targets=("lm_head",))


def _fake_adapter(folder, fingerprint: str) -> None:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"r": 8, "target_modules": ["q_proj"]}))
    (folder / "adapter_model.safetensors").write_bytes(b"")
    (folder / lora.META).write_text(json.dumps({"fingerprint": fingerprint}))


def test_find_picks_this_models_adapter_and_refuses_others(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(adapters, "SHIPPED", tmp_path / "shipped")
    fp = "a" * 64
    assert adapters.find("auto", tmp_path, fp) is None  # none trained, none shipped
    shipped = tmp_path / "shipped" / adapters.folder_name(fp)
    _fake_adapter(shipped, fp)
    assert adapters.find("auto", tmp_path, fp) == shipped
    mine = adapters.user_folder(tmp_path, fp)
    _fake_adapter(mine, fp)
    assert adapters.find("auto", tmp_path, fp) == mine  # the user's own wins over the shipped one
    assert adapters.find("off", tmp_path, fp) is None
    other = tmp_path / "other"
    _fake_adapter(other, "b" * 64)
    with caplog.at_level(logging.WARNING, logger="kvmem.reader.adapters"):
        assert adapters.find(str(other), tmp_path, fp) is None
    assert "refused, plain KV mode: trained for model bbbbbbbbbbbb, this model is aaaaaaaaaaaa" in caplog.text
    caplog.clear()
    (mine / "adapter_model.safetensors").unlink()
    with caplog.at_level(logging.WARNING, logger="kvmem.reader.adapters"):
        assert adapters.find("auto", tmp_path, fp) is None
    assert "adapter_model.safetensors is missing" in caplog.text
    (mine / "adapter_model.safetensors").write_bytes(b"")
    (mine / "adapter_config.json").write_text(json.dumps({"r": 8, "target_modules": ["lm_head"]}))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvmem.reader.adapters"):
        assert adapters.find("auto", tmp_path, fp) is None
    assert "target_modules must be a list among" in caplog.text
