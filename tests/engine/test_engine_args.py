"""The in-process engine's arguments: engine.vllm_args read by vLLM's own parser into LLM()
keyword arguments, over kvmem's settings; an unknown one refused, by name, before any engine
starts. vLLM's parser is imported; no engine is started."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmem.config import Config, ConfigError, EngineConfig, KVConfig
from kvmem.engine import replica
from kvmem.model import ModelInfo

pytest.importorskip("vllm")

MODEL = ModelInfo(Path("/models/m"), "f" * 64, "bfloat16", 2, 1, 64)


def _config(*vllm_args: str, **engine) -> Config:
    return Config(home=Path("/h"), kv=KVConfig(reader_adapter="off"), engine=EngineConfig(vllm_args=vllm_args, **engine))


def test_pass_through_reaches_the_engine_kwargs_over_kvmems_own():
    kwargs = replica.engine_settings(_config("--quantization", "fp8", "--trust-remote-code", "--max-num-seqs", "4",
                                             "--no-enforce-eager"), MODEL, None, cpu=True)
    assert (kwargs["quantization"], kwargs["trust_remote_code"], kwargs["max_num_seqs"]) == ("fp8", True, 4)
    assert kwargs["enforce_eager"] is False  # given at vLLM's default, it still wins over kvmem's CPU default
    assert (kwargs["model"], kwargs["max_model_len"], kwargs["gpu_memory_utilization"]) == ("/models/m", 4096, 0.5)
    assert kwargs["kv_transfer_config"]["kv_connector"] == replica.CONNECTOR


def test_without_pass_through_only_kvmems_settings_are_given():
    kwargs = replica.engine_settings(_config(max_model_len=2048), MODEL, None, cpu=False)
    assert kwargs["max_model_len"] == 2048 and kwargs["enforce_eager"] is False
    assert "gpu_memory_utilization" not in kwargs and "quantization" not in kwargs


@pytest.mark.parametrize("args,named", [(("--quantization", "fp8", "--bogus-flag"), "--bogus-flag"),
                                        (("--gpu-memory-utilization", "lots"), "'lots'"),
                                        (("--chat-template", "t.jinja"), "--chat-template")])  # a server flag
def test_unknown_or_bad_arguments_are_refused_by_name(args, named):
    with pytest.raises(ConfigError, match=named):
        replica.engine_kwargs(args)


def test_start_engine_refuses_them_before_starting_vllm(monkeypatch):
    from kvmem.engine import llm
    from kvmem.engine.start import start_engine

    monkeypatch.setattr(llm, "LocalEngine", lambda *a: pytest.fail("the engine was started"))
    with pytest.raises(ConfigError, match="--bogus-flag"):
        start_engine(_config("--bogus-flag"), MODEL, blobs=None)


def test_kvmem_serve_refuses_them_as_a_usage_error(monkeypatch, tmp_path, capsys):
    from kvmem.cli import main
    from kvmem.server import cli as server_cli

    monkeypatch.setattr(server_cli, "run", lambda *a, **k: pytest.fail("the server was started"))
    for name in ("KVMEM_ENGINE_URL", "KVMEM_HOME"):
        monkeypatch.delenv(name, raising=False)
    assert main(["serve", "--home", str(tmp_path), "--", "--bogus-flag", "1"]) == 2
    assert "--bogus-flag" in capsys.readouterr().err


def test_vllms_spellings_are_read_as_vllm_reads_them():
    assert replica.engine_kwargs(("--max_num_batched_tokens", "512", "--max-num-seqs=2")) == {
        "max_num_batched_tokens": 512, "max_num_seqs": 2}
