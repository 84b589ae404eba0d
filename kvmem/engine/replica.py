"""A stock vLLM OpenAI server as a kvmem replica: the connector's settings and the command line.

vLLM loads out-of-tree KV connectors by module path from `--kv-transfer-config`, so a replica is
the unmodified API server (`python -m vllm.entrypoints.openai.api_server`) with kvmem's connector
named there. The in-process engine (llm.py) and a replica use the same settings, built here.
This module does not import vLLM: a gateway host without vLLM prints the command for another.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kvmem.config import Config
from kvmem.connector.plan import ConnectorSettings
from kvmem.model import ModelInfo
from kvmem.reader import adapters
from kvmem.reader.lora import folder_targets, has_lora, lora_rank

CONNECTOR = "KvmemConnector"
CONNECTOR_MODULE = "kvmem.connector.connector"


def transfer_config(config: Config, model: ModelInfo, adapter: Path | None = None) -> dict:
    """vLLM's KVTransferConfig fields for kvmem's connector (kv_both: it loads and saves).
    `adapter`: the reader adapter served, whose KV map (if it has one) the connector applies."""
    return {
        "kv_connector": CONNECTOR,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",  # a blob that fails to load is prefilled as text
        "kv_connector_extra_config": ConnectorSettings(
            kv_dir=str(config.kv_dir), fingerprint=model.fingerprint, codec=config.kv.codec,
            hot_cache_mib=config.kv.hot_cache_mib, shared_url=config.kv.shared_url,
            reader_adapter=str(adapter) if adapter is not None else None,
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
            python: str = sys.executable) -> list[str]:
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
           "--max-num-seqs", str(ec.max_num_seqs), "--gpu-memory-utilization", str(ec.gpu_memory_utilization),
           "--seed", str(ec.seed), "--enable-prefix-caching", "--enable-prompt-tokens-details",
           "--return-tokens-as-token-ids", "--kv-transfer-config", json.dumps(transfer_config(config, model, adapter))]
    if ec.load_format != "auto":
        cmd += ["--load-format", ec.load_format]
    if adapter is not None and has_lora(adapter):
        cmd += ["--enable-lora", "--max-loras", "1", "--max-cpu-loras", "1", "--max-lora-rank", str(lora_rank(adapter)),
                "--lora-target-modules", *folder_targets(adapter), "--lora-modules", f"{reader_name(model)}={adapter}"]
    if ec.enforce_eager or (ec.enforce_eager is None and _cpu_only()):
        cmd.append("--enforce-eager")
    return cmd


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
