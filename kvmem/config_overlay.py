"""The one configuration overlay every command builds its Config with.

    defaults  <  config file (--config FILE.toml)  <  KVMEM_* environment  <  flags

each later layer overriding the earlier ones key by key, and each value recorded with where it
came from (`Source`), which `kvmem config show` prints. `kvmem` and its subcommands, `kvmem
replica`, `kvmem serve` and `kvmem gateway` (server/settings.py) all resolve through `resolve`, so
a setting means the same and wins the same way whichever command reads it.

The config file is TOML: top-level `home`, `models_home`, `kv_root`, `database_url`; tables
[engine], [kv], [prompt], [memory], [retrieval] holding the fields of kvmem.config's dataclasses;
and [server] / [tenants], read by `kvmem serve` only (server/settings.py), so one file can serve
every command. `[server] data_dir` is read as `home` (the spelling older files used).

The default `models_home` is the environment's data folder plus "models" (KVMEM_HOME or
~/.cache/kvmem), not the --home of the run: converted models are shared by every data folder a
command is pointed at, so a throw-away --home does not convert the model again.
"""

from __future__ import annotations

import argparse
import os
import sys
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from kvmem.config import PATHS, SECTIONS, Config, ConfigError, builtin_home, default_home, flatten, keys
from kvmem.config_env import env_values
from kvmem.errors import KvmemError

SOURCES = ("default", "file", "env", "flag")  # lowest to highest precedence
TOP_LEVEL = tuple(k for k in keys() if "." not in k)  # settable at the top of a config file
SERVE_TABLES = ("server", "tenants")  # read by kvmem serve / gateway (server/settings.py)

# argparse dest -> (flat config key, the flag as typed). A dest not here is no configuration.
# "data_dir" is the mapping key older callers of server.settings.load pass for --home.
FLAGS: dict[str, tuple[str, str]] = {
    "home": ("home", "--home"),
    "data_dir": ("home", "--data-dir"),
    "models_home": ("models_home", "--models-home"),
    "model": ("engine.model", "--model"),
    "replicas": ("engine.url", "--replicas"),
    "routing": ("engine.routing", "--routing"),
    "database_url": ("database_url", "--database-url"),
    "kv_shared_url": ("kv.shared_url", "--kv-shared-url"),
    "text_facts": ("kv.text_facts", "--text-facts"),
    "text_facts_rule": ("kv.text_facts_rule", "--text-facts-rule"),
    "recompute": ("kv.recompute", "--recompute"),
    "recompute_rule": ("kv.recompute_rule", "--recompute-rule"),
    "fidelity": ("kv.fidelity", "--fidelity"),
    "max_model_len": ("engine.max_model_len", "--max-model-len"),
    "gpu_memory_utilization": ("engine.gpu_memory_utilization", "--gpu-memory-utilization"),
    "dtype": ("engine.dtype", "--dtype"),
    "vllm_args": ("engine.vllm_args", "-- VLLM_ARGS"),
    "extract_url": ("extract.url", "--extract-url"),
    "extract_model": ("extract.model", "--extract-model"),
}


@dataclass(frozen=True)
class Source:
    """Where a value came from: `kind` is one of SOURCES; `detail` the variable, the file (and
    table), or the flag; "" for a plain default."""

    kind: str
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.kind} {self.detail}".rstrip()


@dataclass(frozen=True)
class ConfigFile:
    """A parsed --config TOML file. `data` is the whole document: serve reads its own tables."""

    path: Path
    data: Mapping[str, Any]

    @classmethod
    def read(cls, path: Path | str) -> "ConfigFile":
        try:
            return cls(Path(path), tomllib.loads(Path(path).read_text(encoding="utf-8")))
        except OSError as e:
            raise ConfigError(f"cannot read --config {path}: {e.strerror or e}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"--config {path} is not valid TOML: {e}") from None

    def values(self) -> dict[str, tuple[Any, Source]]:
        """{flat key: (value, Source)} for every setting the file gives; unknown names refused."""
        out: dict[str, tuple[Any, Source]] = {}
        server = self.table("server")
        if "data_dir" in server:
            out["home"] = (_typed("home", server["data_dir"]), Source("file", f"{self.path} [server] data_dir"))
        unknown = sorted(set(self.data) - set(TOP_LEVEL) - set(SECTIONS) - set(SERVE_TABLES))
        if unknown:
            raise ConfigError(f"{self.path}: unknown sections {unknown}")
        for name in TOP_LEVEL:
            if name in self.data:
                out[name] = (_typed(name, self.data[name]), Source("file", str(self.path)))
        for section, cls in SECTIONS.items():
            table = self.table(section)
            names = {f.name for f in fields(cls)}
            if set(table) - names:
                raise ConfigError(f"[{section}]: unknown settings {sorted(set(table) - names)}; known: {sorted(names)}")
            out.update({f"{section}.{k}": (v, Source("file", f"{self.path} [{section}]")) for k, v in table.items()})
        return out

    def table(self, name: str) -> Mapping[str, Any]:
        table = self.data.get(name, {})
        if not isinstance(table, Mapping):
            raise ConfigError(f"[{name}] must be a table")
        return table


@dataclass(frozen=True)
class Resolved:
    """The effective Config and, for each of its flat keys, the Source of its value."""

    config: Config
    sources: Mapping[str, Source]

    def rows(self) -> list[tuple[str, Any, Source]]:
        """(flat key, value, Source) for every setting, in Config's field order."""
        values = flatten(self.config)
        return [(key, values[key], self.sources[key]) for key in keys()]


def resolve(*, file: ConfigFile | None = None, env: Mapping[str, str] | None = None,
            flags: Mapping[str, Any] | None = None) -> Resolved:
    """Layer defaults < file < env < flags. flags: argparse dests (vars(args)); those FLAGS
    does not name are ignored, and None or "" means not given (an empty --model never did)."""
    env = os.environ if env is None else env
    layers = [_defaults(env), file.values() if file else {},
              {key: (value, Source("env", var)) for key, (value, var) in env_values(env).items()},
              _flag_values(flags or {})]
    merged: dict[str, tuple[Any, Source]] = {}
    for layer in layers:
        merged.update(layer)
    try:
        config = Config.from_values({key: value for key, (value, _) in merged.items()})
    except ConfigError:
        raise
    except KvmemError as e:  # e.g. an unknown codec: to a command, a configuration error like the rest
        raise ConfigError(str(e)) from e
    return Resolved(config, {key: source for key, (_, source) in merged.items()})


def from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> Resolved:
    """The overlay for a parsed command line: its --config file, the environment, its flags."""
    path = getattr(args, "config_file", None)
    return resolve(file=ConfigFile.read(path) if path else None, env=env, flags=vars(args))


def _defaults(env: Mapping[str, str]) -> dict[str, tuple[Any, Source]]:
    """The dataclasses' defaults; models_home: the environment's home + "models" (module doc)."""
    out = {key: (value, Source("default")) for key, value in flatten(Config(home=builtin_home())).items()}
    out["models_home"] = (default_home(env) / "models",
                          Source("default", "$KVMEM_HOME/models" if "KVMEM_HOME" in env else ""))
    return out


def _flag_values(flags: Mapping[str, Any]) -> dict[str, tuple[Any, Source]]:
    out: dict[str, tuple[Any, Source]] = {}
    for dest, (key, flag) in FLAGS.items():
        value = flags.get(dest)
        if value is not None and value != "" and value != []:  # []: nothing after `--`
            out[key] = (_typed(key, value), Source("flag", flag))
    return out


def _typed(key: str, value: Any) -> Any:
    """Folders as Paths (TOML and argparse without type=Path give text)."""
    if key not in PATHS or value is None:
        return value
    try:
        return Path(value)
    except TypeError:
        raise ConfigError(f"{key} must be a folder path, got {value!r}") from None


# -- the options every command takes ------------------------------------------------------------


class DeprecatedAlias(argparse.Action):
    """An old spelling (--data-dir for --home) still read, with a note on stderr, so scripts
    written for it keep working while they are moved over."""

    def __init__(self, *args, canonical: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.canonical = canonical

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(f"{parser.prog}: {option_string} is deprecated; use {self.canonical}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_common_options(p: argparse.ArgumentParser, *, suppress: bool, data_dir_alias: bool = False) -> None:
    """--home, --models-home, --model, --config and -v, the same on every command.

    suppress: for a subcommand's copy: a flag not given there leaves no default behind, so the
    one given before the subcommand name (on the top-level parser) stands. data_dir_alias: also
    read the hidden --data-dir (kvmem serve and gateway took it before --home)."""
    unset = argparse.SUPPRESS if suppress else None
    p.add_argument("--home", type=Path, default=unset,
                   help="data folder: facts and KV blobs (default: $KVMEM_HOME or ~/.cache/kvmem)")
    if data_dir_alias:
        p.add_argument("--data-dir", dest="home", type=Path, default=unset, action=DeprecatedAlias,
                       canonical="--home", help=argparse.SUPPRESS)
    p.add_argument("--models-home", type=Path, default=unset,
                   help=f"where converted models are kept (default: {default_home() / 'models'})")
    p.add_argument("--model", default=unset, help="a bundled model (smollm2-135m, gemma3-270m), a local HF model "
                                                  "folder or a hub id (default: bundled SmolLM2-135M)")
    p.add_argument("--config", dest="config_file", type=Path, default=unset, metavar="FILE.toml",
                   help="a TOML config file: [engine], [kv], [memory], ... (flags and KVMEM_* variables win "
                        "over it; `kvmem config show` prints what is in effect)")
    p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS if suppress else False,
                   help="log progress (INFO)")


def add_engine_options(p: argparse.ArgumentParser) -> None:
    """vLLM's settings on the commands that start or exec it (serve, replica): three first-class
    flags, and any other engine argument of vLLM's after `--` (EngineConfig.vllm_args)."""
    p.add_argument("--max-model-len", type=int, help="the longest prompt plus reply, in tokens (default 4096)")
    p.add_argument("--gpu-memory-utilization", type=float, metavar="SHARE",
                   help="share of GPU memory vLLM reserves (default: vLLM's own on GPUs; 0.5 of RAM on CPU)")
    p.add_argument("--dtype", help="the weights' dtype: bfloat16 (default), float16, float32")
    p.add_argument("vllm_args", nargs="*", metavar="-- VLLM_ARGS",
                   help="after `--`: more vLLM engine arguments, e.g. -- --quantization fp8 --enforce-eager "
                        "(docs/server.md)")
