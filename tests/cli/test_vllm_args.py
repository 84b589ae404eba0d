"""vLLM's settings on `kvmem replica` / `kvmem serve`: --max-model-len, --gpu-memory-utilization
and --dtype become config values through the overlay, and vLLM engine arguments after `--`
become engine.vllm_args, which a replica's command line carries verbatim. No vLLM here."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmem.cli.parser import build_parser
from kvmem.config import Config, ConfigError, EngineConfig, KVConfig
from kvmem.config_overlay import ConfigFile, from_args, resolve
from kvmem.engine import replica
from kvmem.model import ModelInfo

MODEL = ModelInfo(Path("/models/m"), "f" * 64, "bfloat16", 2, 1, 64)


def _resolved(*argv: str):
    return from_args(build_parser().parse_args(list(argv)), env={})


@pytest.mark.parametrize("command", ["replica", "serve"])
def test_engine_flags_and_pass_through_become_config_values(command):
    resolved = _resolved(command, "--max-model-len", "2048", "--gpu-memory-utilization", "0.8", "--dtype", "float16",
                         "--", "--quantization", "fp8", "--enforce-eager")
    ec = resolved.config.engine
    assert (ec.max_model_len, ec.gpu_memory_utilization, ec.dtype) == (2048, 0.8, "float16")
    assert ec.vllm_args == ("--quantization", "fp8", "--enforce-eager")
    assert str(resolved.sources["engine.vllm_args"]) == "flag -- VLLM_ARGS"
    assert str(resolved.sources["engine.max_model_len"]) == "flag --max-model-len"


def test_no_pass_through_is_not_a_flag_value():
    resolved = _resolved("replica", "--print")
    assert resolved.config.engine.vllm_args == ()
    assert resolved.sources["engine.vllm_args"].kind == "default"


def test_gateway_takes_no_engine_arguments():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["gateway", "--replicas", "http://r:8000", "--max-model-len", "2048"])


@pytest.mark.parametrize("text", ['vllm_args = ["--quantization", "fp8"]', 'vllm_args = "--quantization fp8"'])
def test_config_file_takes_a_list_or_a_shell_string(tmp_path, text):
    path = tmp_path / "c.toml"
    path.write_text(f"[engine]\n{text}\n")
    assert resolve(file=ConfigFile.read(path), env={}).config.engine.vllm_args == ("--quantization", "fp8")


@pytest.mark.parametrize("args,named", [
    (["--max-model-len", "9"], "--max-model-len"), (["--max_model_len=9"], "--max-model-len"),
    (["--dtype", "half"], "--dtype"), (["--kv-transfer-config.kv_role", "kv_consumer"], "--kv-transfer-config"),
    (["--enforce-eager", "--served-model-name", "x"], "--served-model-name"),
])
def test_arguments_kvmem_sets_itself_are_refused_with_the_setting_to_use(args, named):
    with pytest.raises(ConfigError, match=named):
        _resolved("replica", "--", *args)


def test_pass_through_must_start_with_a_flag():
    with pytest.raises(ValueError, match="'stray'"):  # the dataclass's own check; the overlay makes it a ConfigError
        EngineConfig(vllm_args=("stray",))
    with pytest.raises(ConfigError, match="'stray'"):
        _resolved("replica", "stray")


def test_replica_command_carries_the_pass_through_last(monkeypatch):
    monkeypatch.setattr(replica, "_cpu_only", lambda: False)
    config = Config(home=Path("/h"), kv=KVConfig(reader_adapter="off"),
                    engine=EngineConfig(max_model_len=2048, vllm_args=("--quantization", "fp8", "--trust-remote-code")))
    cmd = replica.command(config, MODEL)
    assert cmd[-3:] == ["--quantization", "fp8", "--trust-remote-code"]  # last: vLLM keeps the last value given
    assert cmd[cmd.index("--max-model-len") + 1] == "2048"
    assert "--gpu-memory-utilization" not in cmd  # on a GPU: vLLM's own default
    assert "--enforce-eager" not in cmd


@pytest.mark.parametrize("given,cpu,expected", [(None, False, None), (None, True, "0.5"), (0.8, False, "0.8"),
                                                (0.1, True, "0.1")])
def test_gpu_memory_share_is_vllms_default_on_gpus_and_half_on_cpu(monkeypatch, given, cpu, expected):
    monkeypatch.setattr(replica, "_cpu_only", lambda: cpu)
    config = Config(home=Path("/h"), kv=KVConfig(reader_adapter="off"),
                    engine=EngineConfig(gpu_memory_utilization=given))
    cmd = replica.command(config, MODEL)
    got = cmd[cmd.index("--gpu-memory-utilization") + 1] if "--gpu-memory-utilization" in cmd else None
    assert got == expected


def test_gpu_memory_share_out_of_range_is_refused():
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        _resolved("replica", "--gpu-memory-utilization", "1.5")


def test_the_environment_gives_them_as_one_shell_string(monkeypatch):
    from kvmem.config import Config

    monkeypatch.setenv("KVMEM_VLLM_ARGS", "--max-num-seqs 4 --override-generation-config '{\"a\": 1}'")
    assert Config.from_env().engine.vllm_args == ("--max-num-seqs", "4", "--override-generation-config", '{"a": 1}')
