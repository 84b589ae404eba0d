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


def test_a_folder_without_config_is_refused(tmp_path):
    with pytest.raises(ModelError, match="config.json"):
        resolve_model(str(tmp_path), tmp_path)
