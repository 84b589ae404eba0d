"""Server settings and kvmem's Config for `kvmem serve` / `kvmem gateway`, through the one overlay
every command uses (kvmem/config_overlay.py): defaults < the --config TOML file < KVMEM_*
variables < flags, for the server's own settings as for kvmem's.

The config file is TOML:

    home = "/srv/kvmem"      # top level: home, models_home, kv_root, database_url
    [server]                 # any ServerSettings field
    max_inflight = 64
    [tenants]                # tenant = "key", or a list of keys; every key belongs to one tenant
    acme = ["sk-acme-1", "sk-acme-2"]
    [engine]                 # kvmem.config.EngineConfig fields; [kv], [prompt], [memory], [retrieval] likewise
    max_model_len = 4096

Environment: KVMEM_API_KEYS="tenant=key,tenant=key" (added to [tenants], not instead of them),
KVMEM_SERVER_MAX_INFLIGHT, KVMEM_SERVER_MAX_BODY_BYTES, KVMEM_SERVER_RATE_LIMIT_PER_MIN, and kvmem's
own KVMEM_* variables.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvmem.config import Config, ConfigError
from kvmem.config_overlay import ConfigFile, Resolved, resolve

SEP = "::"  # tenant/user separator inside the user ids kvmem stores
_TENANT = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_ENV_INTS = {"max_inflight": "KVMEM_SERVER_MAX_INFLIGHT", "max_body_bytes": "KVMEM_SERVER_MAX_BODY_BYTES",
             "rate_limit_per_min": "KVMEM_SERVER_RATE_LIMIT_PER_MIN"}


class SettingsError(ConfigError):
    """A bad flag, config file or environment variable of the server (a ConfigError, as the
    overlay raises for kvmem's own settings; load() raises this one for both)."""


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    max_inflight: int = 64  # chat requests answered at once; any more get 429 at once
    # Requests a minute per tenant (all at once after a quiet minute), across every gateway on the
    # same kv.shared_url Redis; more get 429 with Retry-After. None: unlimited (server/ratelimit.py).
    rate_limit_per_min: int | None = None
    max_body_bytes: int = 4 << 20
    default_max_tokens: int = 128  # when a chat request sets neither max_tokens nor max_completion_tokens
    max_n: int = 8  # choices one chat request may ask for (`n`); each costs a generation
    graceful_timeout_s: float = 30.0  # on SIGTERM, in-flight requests get this long to finish
    allow_public_without_keys: bool = False
    served_model_name: str | None = None  # default: the model given, or the bundled model's name
    # /docs, /redoc and /openapi.json, served without a key: they describe the API and hold no
    # tenant's data. False removes all three (for servers that must not advertise their API).
    docs: bool = True
    ui: bool = True  # the inspector page at /ui (docs/ui.md), behind the same keys as the API
    api_keys: Mapping[str, str] = field(default_factory=dict)  # key -> tenant

    def __post_init__(self) -> None:
        for name in ("port", "max_inflight", "max_body_bytes", "default_max_tokens", "max_n"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (0 if name == "port" else 1):
                raise SettingsError(f"{name} must be a positive integer, got {value!r}")
        rate = self.rate_limit_per_min
        if rate is not None and (not isinstance(rate, int) or isinstance(rate, bool) or rate < 1):
            raise SettingsError(f"rate_limit_per_min must be a positive integer (or unset), got {rate!r}")

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
    """flags: ServerSettings fields plus the overlay's (home or data_dir, model, models_home, replicas,
    ...: config_overlay.FLAGS); None means not given, other names are ignored."""
    settings, resolved = load_resolved(path, env, flags)
    return settings, resolved.config


def load_resolved(path: Path | None, env: Mapping[str, str],
                  flags: Mapping[str, Any]) -> tuple[ServerSettings, Resolved]:
    """load(), with where each of kvmem's settings came from."""
    try:
        file = ConfigFile.read(path) if path else None
        resolved = resolve(file=file, env=env, flags=flags)
        server = dict(file.table("server")) if file else {}
        tenants = file.table("tenants") if file else {}
    except ConfigError as e:  # callers of load() catch SettingsError for every settings problem
        raise SettingsError(str(e)) from None
    server.update({name: _int(var, env[var]) for name, var in _ENV_INTS.items() if env.get(var)})
    names = {f.name for f in dataclasses.fields(ServerSettings)}
    server.update({k: v for k, v in flags.items() if v is not None and k in names})
    server["api_keys"] = parse_keys(tenants, env.get("KVMEM_API_KEYS", ""))
    return _build(ServerSettings, server, "[server]"), resolved


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


def _build(cls, values: Mapping[str, Any], where: str):
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(values) - names - {"data_dir"}  # [server] data_dir: the overlay reads it as home
    if unknown:
        raise SettingsError(f"{where}: unknown settings {sorted(unknown)}; known: {sorted(names)}")
    try:
        return cls(**{k: v for k, v in values.items() if k in names})
    except TypeError as e:
        raise SettingsError(f"{where}: {e}") from None


def _int(name: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise SettingsError(f"{name} must be an integer, got {raw!r}") from None
