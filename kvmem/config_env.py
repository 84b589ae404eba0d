"""The KVMEM_* variables that set kvmem's configuration (`ENV`), and reading them (`env_values`).

The one place that reads the environment for kvmem's settings: `Config.from_env` (the Python API)
layers these over the defaults, the commands' overlay (config_overlay.py) between their config
file and their flags. The server's own variables are in server/settings.py.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvmem.errors import KvmemError


class ConfigError(KvmemError, ValueError):
    """A configuration value kvmem cannot use: a bad KVMEM_* variable, config file entry or
    value out of range. A ValueError too, as the dataclasses' own checks have always raised."""


def _mib_or_none(value: str) -> float | None:
    """"" -> None (unlimited), else the number of MiB."""
    return None if value == "" else float(value)


def _tristate(value: str) -> bool | None:
    """"" -> None (automatic), "0" -> False, anything else -> True."""
    return None if value == "" else value != "0"


@dataclass(frozen=True)
class EnvVar:
    """A KVMEM_* variable: its name and how its text is read.

    blank_unset: "" reads as not set (for those whose "" always meant the default), so an empty
    variable left in a shell does not hide a config file's value."""

    name: str
    parse: Callable[[str], Any]
    blank_unset: bool = False


# flat key -> its variable. Keys absent here have no variable (config file or flags only).
ENV: dict[str, EnvVar] = {
    "home": EnvVar("KVMEM_HOME", Path),
    "database_url": EnvVar("KVMEM_DATABASE_URL", str, blank_unset=True),
    "engine.model": EnvVar("KVMEM_MODEL", str, blank_unset=True),
    "engine.block_size": EnvVar("KVMEM_BLOCK_SIZE", int),
    "engine.max_model_len": EnvVar("KVMEM_MAX_MODEL_LEN", int),
    "engine.cpu_kv_space_gib": EnvVar("KVMEM_CPU_KV_SPACE_GIB", int),
    "engine.gpu_memory_utilization": EnvVar("KVMEM_GPU_MEMORY_UTILIZATION", float),
    "engine.load_format": EnvVar("KVMEM_LOAD_FORMAT", str),
    "engine.enforce_eager": EnvVar("KVMEM_ENFORCE_EAGER", _tristate, blank_unset=True),
    "engine.url": EnvVar("KVMEM_ENGINE_URL", str, blank_unset=True),
    "engine.routing": EnvVar("KVMEM_ENGINE_ROUTING", str),
    "engine.connect_timeout_s": EnvVar("KVMEM_ENGINE_CONNECT_TIMEOUT_S", float),
    "engine.reply_timeout_s": EnvVar("KVMEM_ENGINE_REPLY_TIMEOUT_S", float),
    "engine.vllm_args": EnvVar("KVMEM_VLLM_ARGS", str, blank_unset=True),  # one shell-quoted string
    "kv.codec": EnvVar("KVMEM_KV_CODEC", str),
    "kv.recompute": EnvVar("KVMEM_KV_RECOMPUTE", float),
    "kv.recompute_rule": EnvVar("KVMEM_KV_RECOMPUTE_RULE", str),
    "kv.reader_adapter": EnvVar("KVMEM_READER_ADAPTER", str),
    "kv.hot_cache_mib": EnvVar("KVMEM_HOT_CACHE_MIB", int),
    "kv.disk_budget_mib": EnvVar("KVMEM_KV_DISK_BUDGET_MIB", _mib_or_none, blank_unset=True),
    "kv.tenant_quota_mib": EnvVar("KVMEM_KV_TENANT_QUOTA_MIB", _mib_or_none, blank_unset=True),
    "kv.shared_url": EnvVar("KVMEM_KV_SHARED_URL", str, blank_unset=True),
    "kv.text_facts": EnvVar("KVMEM_KV_TEXT_FACTS", int),
    "kv.text_facts_rule": EnvVar("KVMEM_KV_TEXT_FACTS_RULE", str),
    "kv.fidelity": EnvVar("KVMEM_KV_FIDELITY", str, blank_unset=True),
    "retrieval.mode": EnvVar("KVMEM_RETRIEVAL", str),
    "retrieval.depth": EnvVar("KVMEM_RETRIEVAL_DEPTH", int),
    "retrieval.dense_weight": EnvVar("KVMEM_RETRIEVAL_DENSE_WEIGHT", float),
    "extract.url": EnvVar("KVMEM_EXTRACT_URL", str, blank_unset=True),
    "extract.model": EnvVar("KVMEM_EXTRACT_MODEL", str, blank_unset=True),
    "extract.api_key": EnvVar("KVMEM_EXTRACT_API_KEY", str, blank_unset=True),
    "extract.on_unavailable": EnvVar("KVMEM_EXTRACT_ON_UNAVAILABLE", str),
}


def env_values(env: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    """{flat key: (value, variable name)} for each KVMEM_* variable set in env."""
    out: dict[str, tuple[Any, str]] = {}
    for key, var in ENV.items():
        raw = env.get(var.name)
        if raw is None or (raw == "" and var.blank_unset):
            continue
        try:
            out[key] = (var.parse(raw), var.name)
        except ValueError as e:
            raise ConfigError(f"{var.name}={raw!r}: {e}") from None
    return out
