"""Server settings: flags win over the --config TOML file, which wins over KVMEM_* variables.

The config file is TOML:

    [server]                 # any ServerSettings field
    max_inflight = 64
    [tenants]                # tenant = "key", or a list of keys; every key belongs to one tenant
    acme = ["sk-acme-1", "sk-acme-2"]
    [engine]                 # kvmem.config.EngineConfig fields; [kv], [prompt], [memory] likewise
    max_model_len = 4096

Environment: KVMEM_API_KEYS="tenant=key,tenant=key", KVMEM_SERVER_MAX_INFLIGHT,
KVMEM_SERVER_MAX_BODY_BYTES, and kvmem's own KVMEM_* engine variables.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvmem.config import Config, default_home
from kvmem.errors import KvmemError

SEP = "::"  # tenant/user separator inside the user ids kvmem stores
_TENANT = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_ENV_INTS = {"max_inflight": "KVMEM_SERVER_MAX_INFLIGHT", "max_body_bytes": "KVMEM_SERVER_MAX_BODY_BYTES"}
_SECTIONS = ("engine", "kv", "prompt", "memory")


class SettingsError(KvmemError):
    """A bad flag, config file or environment variable."""


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    max_inflight: int = 64  # chat requests answered at once; any more get 429 at once
    max_body_bytes: int = 4 << 20
    default_max_tokens: int = 128  # when a chat request sets neither max_tokens nor max_completion_tokens
    graceful_timeout_s: float = 30.0  # on SIGTERM, in-flight requests get this long to finish
    allow_public_without_keys: bool = False
    served_model_name: str | None = None  # default: the model given, or the bundled model's name
    # /docs, /redoc and /openapi.json, served without a key: they describe the API and hold no
    # tenant's data. False removes all three (for servers that must not advertise their API).
    docs: bool = True
    api_keys: Mapping[str, str] = field(default_factory=dict)  # key -> tenant

    def __post_init__(self) -> None:
        for name in ("port", "max_inflight", "max_body_bytes", "default_max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (0 if name == "port" else 1):
                raise SettingsError(f"{name} must be a positive integer, got {value!r}")

    @property
    def public(self) -> bool:
        return not is_loopback(self.host)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: assume it is reachable from elsewhere


def load(path: Path | None, env: Mapping[str, str], flags: Mapping[str, Any]) -> tuple[ServerSettings, Config]:
    """flags: ServerSettings fields plus data_dir, model, models_home; None means not given."""
    data = _read_toml(path) if path else {}
    unknown = set(data) - {"server", "tenants", *_SECTIONS}
    if unknown:
        raise SettingsError(f"{path}: unknown sections {sorted(unknown)}")
    server = {name: _int(var, env[var]) for name, var in _ENV_INTS.items() if env.get(var)}
    server.update(data.get("server", {}))
    server.update({k: v for k, v in flags.items() if v is not None and k not in ("data_dir", "model", "models_home")})
    server["api_keys"] = parse_keys(data.get("tenants", {}), env.get("KVMEM_API_KEYS", ""))
    settings = _build(ServerSettings, server, "[server]")
    return settings, _kvmem_config(data, server.pop("data_dir", None), flags)


def _kvmem_config(data: dict, file_data_dir, flags: Mapping[str, Any]) -> Config:
    config = Config.from_env()
    for section in _SECTIONS:
        if section in data:
            config = replace(config, **{section: _build(type(getattr(config, section)), data[section], f"[{section}]",
                                                       base=getattr(config, section))})
    home = flags.get("data_dir") or file_data_dir
    models_home = flags.get("models_home") or config.models_home or default_home() / "models"
    config = replace(config, models_home=Path(models_home), home=Path(home) if home else config.home)
    if flags.get("model"):
        config = replace(config, engine=replace(config.engine, model=flags["model"]))
    return config


def parse_keys(table: Mapping[str, Any], env_value: str) -> dict[str, str]:
    """{key: tenant} from the config's [tenants] table and KVMEM_API_KEYS ("tenant=key,...")."""
    pairs = [(t, k) for t, keys in table.items() for k in ([keys] if isinstance(keys, str) else keys)]
    for item in filter(None, (p.strip() for p in env_value.split(","))):
        tenant, sep, key = item.partition("=")
        if not sep:
            raise SettingsError("KVMEM_API_KEYS must be 'tenant=key,tenant=key,...'")
        pairs.append((tenant.strip(), key.strip()))
    keys: dict[str, str] = {}
    for tenant, key in pairs:
        if not isinstance(tenant, str) or not _TENANT.match(tenant):
            raise SettingsError(f"tenant name {tenant!r} must be 1-64 of [A-Za-z0-9_.-]")
        if not isinstance(key, str) or not key:
            raise SettingsError(f"tenant {tenant!r} has an empty or non-string API key")
        if keys.setdefault(key, tenant) != tenant:
            raise SettingsError(f"an API key is given to two tenants ({keys[key]!r} and {tenant!r})")
    return keys


def _build(cls, values: Mapping[str, Any], where: str, base=None):
    if not isinstance(values, Mapping):
        raise SettingsError(f"{where} must be a table")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(values) - names - ({"data_dir"} if cls is ServerSettings else set())
    if unknown:
        raise SettingsError(f"{where}: unknown settings {sorted(unknown)}; known: {sorted(names)}")
    given = {k: v for k, v in values.items() if k in names}
    try:
        return replace(base, **given) if base is not None else cls(**given)
    except TypeError as e:
        raise SettingsError(f"{where}: {e}") from None


def _read_toml(path: Path) -> dict:
    try:
        return tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise SettingsError(f"cannot read --config {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise SettingsError(f"--config {path} is not valid TOML: {e}") from None


def _int(name: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise SettingsError(f"{name} must be an integer, got {raw!r}") from None
