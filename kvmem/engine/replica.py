"""A stock vLLM OpenAI server as a kvmem replica: the connector's settings and the command line.

vLLM loads out-of-tree KV connectors by module path from `--kv-transfer-config`, so a replica is
the unmodified API server (`python -m vllm.entrypoints.openai.api_server`) with kvmem's connector
named there. The in-process engine (llm.py) and a replica use the same settings, built here.
This module does not import vLLM: a gateway host without vLLM prints the command for another.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import shlex
import sys
from pathlib import Path
from typing import Any, NoReturn

from kvmem.config import Config, ConfigError
from kvmem.connector.plan import ConnectorSettings
from kvmem.model import ModelInfo
from kvmem.reader import adapters
from kvmem.reader.lora import folder_targets, has_lora, lora_rank

CONNECTOR = "KvmemConnector"
CONNECTOR_MODULE = "kvmem.connector.connector"


def transfer_config(config: Config, model: ModelInfo, adapter: Path | None = None,
                    replica_url: str | None = None) -> dict:
    """vLLM's KVTransferConfig fields for kvmem's connector (kv_both: it loads and saves).
    `adapter`: the reader adapter served, whose KV map (if it has one) the connector applies.
    `replica_url`: the URL gateways reach this replica by, under which it publishes its RAM tier."""
    return {
        "kv_connector": CONNECTOR,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",  # a blob that fails to load is prefilled as text
        "kv_connector_extra_config": ConnectorSettings(
            kv_dir=str(config.kv_dir), fingerprint=model.fingerprint, codec=config.kv.codec,
            hot_cache_mib=config.kv.hot_cache_mib, shared_url=config.kv.shared_url,
            reader_adapter=str(adapter) if adapter is not None else None, replica_url=replica_url,
        ).to_params(),
    }


def served_name(model: ModelInfo) -> str:
    """The model name a replica serves: the fingerprint's, so a gateway can tell a replica of
    other weights (whose blobs would not fit) from its own."""
    return f"kvmem-{model.fingerprint[:16]}"


def reader_name(model: ModelInfo) -> str:
    """The name a replica serves the model's reader adapter under (a LoRA module)."""
    return f"{served_name(model)}-reader"


def command(config: Config, model: ModelInfo, *, host: str = "127.0.0.1", port: int = 8000,
            python: str = sys.executable, advertise_url: str | None = None) -> list[str]:
    """The replica's command line: vLLM's own API server, kvmem's connector, kvmem's cache layout.

    Prefix caching stays on (it is what keeps a user's facts hot between turns); prompt token
    details report how many prompt tokens the cache and the connector supplied; tokens come back
    as ids, since the gateway tokenizes. The reader adapter found for the model (as the
    in-process engine finds it) is served as a LoRA module on the query projections only.
    """
    ec = config.engine
    adapter = adapters.find(config.kv.reader_adapter, config.home, model.fingerprint)
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server",
           "--model", str(model.path), "--served-model-name", served_name(model),
           "--host", host, "--port", str(port), "--dtype", model.dtype,
           "--block-size", str(ec.block_size), "--max-model-len", str(ec.max_model_len),
           "--max-num-seqs", str(ec.max_num_seqs), "--seed", str(ec.seed), "--enable-prefix-caching", "--enable-prompt-tokens-details",
           "--return-tokens-as-token-ids", "--kv-transfer-config", json.dumps(transfer_config(config, model, adapter, advertise_url))]
    if ec.load_format != "auto":
        cmd += ["--load-format", ec.load_format]
    if adapter is not None and has_lora(adapter):
        cmd += ["--enable-lora", "--max-loras", "1", "--max-cpu-loras", "1", "--max-lora-rank", str(lora_rank(adapter)),
                "--lora-target-modules", *folder_targets(adapter), "--lora-modules", f"{reader_name(model)}={adapter}"]
    share = memory_share(config, cpu=_cpu_only())
    if share is not None:
        cmd += ["--gpu-memory-utilization", str(share)]
    if ec.enforce_eager or (ec.enforce_eager is None and _cpu_only()):
        cmd.append("--enforce-eager")
    return cmd + list(ec.vllm_args)  # last, so they win over kvmem's defaults (vLLM keeps the last value)


def engine_settings(config: Config, model: ModelInfo, adapter: Path | None, *, cpu: bool) -> dict[str, Any]:
    """The in-process engine's LLM() keyword arguments: what command() gives a replica, as
    EngineArgs fields (kv_transfer_config as a dict), then engine.vllm_args over them. cpu: vLLM
    runs on its CPU backend (eager by default there, and a smaller memory share)."""
    ec = config.engine
    # LoRA is switched on only with an adapter: on the CPU backend it also turns graph compilation off.
    # Wrapping only the adapter's own modules keeps LoRA off lm_head, whose LoRA wrapper on vLLM's
    # CPU backend fails on prompt logprobs (scoring) when several requests share a step.
    lora = {"enable_lora": True, "max_loras": 1, "max_cpu_loras": 1, "max_lora_rank": lora_rank(adapter),
            "lora_target_modules": folder_targets(adapter)} if adapter and has_lora(adapter) else {}
    out = dict(model=str(model.path), dtype=model.dtype, block_size=ec.block_size, max_model_len=ec.max_model_len,
               max_num_seqs=ec.max_num_seqs, enable_prefix_caching=True, seed=ec.seed, load_format=ec.load_format,
               enforce_eager=cpu if ec.enforce_eager is None else ec.enforce_eager,
               kv_transfer_config=transfer_config(config, model, adapter), **lora)
    share = memory_share(config, cpu=cpu)
    if share is not None:
        out["gpu_memory_utilization"] = share
    return {**out, **engine_kwargs(ec.vllm_args)}


def memory_share(config: Config, *, cpu: bool) -> float | None:
    """engine.gpu_memory_utilization, where None means vLLM's own default on GPUs (None: pass
    nothing) and 0.5 on CPU, where vLLM's default (0.92 of host RAM, checked against free memory)
    would refuse to start beside any other sizeable process."""
    share = config.engine.gpu_memory_utilization
    return 0.5 if share is None and cpu else share


def engine_kwargs(vllm_args: tuple[str, ...]) -> dict[str, Any]:
    """vLLM's engine keyword arguments (EngineArgs fields) that engine.vllm_args give, read by
    vLLM's own parser, as `vllm serve` would read them. Only the arguments given are returned, so
    kvmem's own settings stand for the rest. Raises ConfigError naming an unknown argument (or a
    bad value) before any engine starts. Imports vLLM."""
    return dict(_engine_kwargs(tuple(vllm_args)))


@functools.lru_cache(maxsize=8)  # start_engine checks them before the engine reads them again
def _engine_kwargs(vllm_args: tuple[str, ...]) -> tuple[tuple[str, Any], ...]:
    if not vllm_args:
        return ()
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    class Parser(FlexibleArgumentParser):
        def error(self, message: str) -> NoReturn:  # argparse would exit the server's process
            raise ConfigError(f"vLLM engine arguments {shlex.join(vllm_args)}: {message}")

    parser = EngineArgs.add_cli_args(Parser(prog="vllm", add_help=False, allow_abbrev=False))
    # An argument given is one whose value is no longer the marker: given at vLLM's default
    # value (e.g. --no-enforce-eager), it must still override kvmem's own setting.
    unset = object()
    marked = {a.dest: unset for a in parser._actions
              if isinstance(a, (argparse._StoreAction, argparse._StoreConstAction, argparse.BooleanOptionalAction))}
    given = vars(parser.parse_args(list(vllm_args), argparse.Namespace(**marked)))
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    return tuple((k, v) for k, v in given.items() if v is not unset and k in fields and
                 (k in marked or v != parser.get_default(k)))


def environment(config: Config) -> dict[str, str]:
    """Variables the replica needs besides its command line (the CPU backend's KV cache size)."""
    return {"VLLM_CPU_KVCACHE_SPACE": str(config.engine.cpu_kv_space_gib)}


def _cpu_only() -> bool:
    """No CUDA device here (torch is there wherever vLLM is; without torch, assume a GPU host)."""
    try:
        import torch
    except ImportError:
        return False
    return not torch.cuda.is_available()
