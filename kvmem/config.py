"""Configuration as frozen dataclasses, and the KVMEM_* variables that set them (`ENV`).

config_env.py's `ENV` and `env_values` are the one place that reads the environment:
`Config.from_env` (the Python API) layers it over the defaults, and the commands' overlay
(config_overlay.py) layers it between their config file and their flags.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

from kvmem.config_env import ConfigError, env_values
from kvmem.errors import KvmemError

# Bumped whenever the blob layout or the meaning of stored K changes; part of every fingerprint.
KV_FORMAT_VERSION = 1


def builtin_home() -> Path:
    """~/.cache/kvmem: the data folder when neither KVMEM_HOME, a config file nor a flag names one."""
    return Path.home() / ".cache" / "kvmem"


def default_home(env: Mapping[str, str] | None = None) -> Path:
    """$KVMEM_HOME, else builtin_home(); env: the variables to read (default os.environ)."""
    env = os.environ if env is None else env
    return Path(env.get("KVMEM_HOME", builtin_home()))


@dataclass(frozen=True)
class EngineConfig:
    """How vLLM is started.

    block_size: paged-cache block size in tokens (CPU needs a multiple of 32; CUDA 16).
    cpu_kv_space_gib: KV cache memory on CPU hosts (VLLM_CPU_KVCACHE_SPACE).
    max_num_seqs: requests batched together per engine step.
    seed: vLLM's random seed, for sampling at temperature > 0.
    load_format: vLLM's; "dummy" runs any architecture from its config.json with random weights
      (timing of big shapes, exactness across families).
    enforce_eager: skip torch.compile and CUDA graphs. None: skip them on CPU, where the engine
      then starts ~4x faster (38 s instead of 158 s for SmolLM2 on 2 cores) at a cost of up to
      ~30% per request (docs/benchmarks.md; KVMEM_ENFORCE_EAGER=0 for a long-running CPU server),
      and keep them on GPUs (CUDA graphs make small decode steps much cheaper there).
    url: a kvmem replica (`kvmem replica`: vLLM's stock OpenAI server with kvmem's connector) to
      send requests to instead of starting vLLM in this process; it must share the KV folder.
    members: read the replicas from the membership table in database_url (PostgreSQL), where
      `kvmem replica --database-url` registers each replica while it serves, instead of a static
      url list (which wins when also given); a gateway with no --replicas does this by itself.
    routing: "rendezvous" (each user to the replica their id hashes to) or "residency" (a KV-mode
      chat to where its facts' KV is in RAM unless that queue costs more; needs kv.shared_url).
    connect_timeout_s: with url, seconds to open a connection to a replica before trying the next.
    reply_timeout_s: with url, the longest a replica may stay silent on a request before it is
      passed over for the next (a non-streamed reply comes whole after its last token: this bounds
      the longest generation); a replica that hangs is found sooner by the probes (docs/deploy.md).
    dtype: the weights' dtype the model is converted to and served in.
    max_model_len: the longest prompt plus reply, in tokens.
    gpu_memory_utilization: the share of device memory vLLM reserves for weights and KV cache.
      None: vLLM's own default on GPUs (0.92 in vLLM 0.32), and 0.5 on CPU, where vLLM reads it
      as the share of host RAM to reserve and refuses to start if that much is not free.
    vllm_args: more of vLLM's engine arguments, as on `vllm serve`'s command line (`-- ARGS`
      after `kvmem serve` / `kvmem replica`; a list or one shell-quoted string in a config file):
      a replica passes them to vLLM verbatim, the in-process engine reads them with vLLM's own
      parser and refuses an unknown one before it starts. They win over kvmem's defaults, except
      the ones kvmem sets itself (--model, --dtype, --max-model-len, --block-size,
      --kv-transfer-config, --served-model-name, --host, --port: OWNED), refused with the
      setting to use instead.
    """

    # vLLM arguments kvmem sets from its own settings and relies on (a pass-through copy would
    # make vLLM and kvmem disagree, e.g. on the dtype in the KV fingerprint): what to use instead.
    ROUTINGS: ClassVar[tuple[str, ...]] = ("rendezvous", "residency")
    OWNED: ClassVar[dict[str, str]] = {
        "--model": "--model (engine.model)", "--dtype": "--dtype (engine.dtype)",
        "--max-model-len": "--max-model-len (engine.max_model_len)", "--block-size": "engine.block_size",
        "--kv-transfer-config": "nothing: it names kvmem's connector",
        "--served-model-name": "nothing: a gateway checks the fingerprint in it",
        "--host": "kvmem replica --host", "--port": "kvmem replica --port",
    }

    model: str | None = None  # None: bundled SmolLM2-135M-Instruct; "gemma3-270m"; a folder; a hub id
    dtype: str = "bfloat16"
    block_size: int = 32
    max_model_len: int = 4096
    cpu_kv_space_gib: int = 2
    gpu_memory_utilization: float | None = None
    max_num_seqs: int = 16
    seed: int = 0
    load_format: str = "auto"
    enforce_eager: bool | None = None
    url: str | None = None
    members: bool = False
    routing: str = "rendezvous"
    connect_timeout_s: float = 5.0
    reply_timeout_s: float = 600.0
    vllm_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        args = shlex.split(self.vllm_args) if isinstance(self.vllm_args, str) else self.vllm_args
        if not all(isinstance(a, str) for a in args):
            raise ValueError(f"engine.vllm_args must be strings, got {args!r}")
        object.__setattr__(self, "vllm_args", tuple(args))  # a TOML list; a tuple keeps the config hashable
        if args and not args[0].startswith("-"):
            raise ValueError(f"engine.vllm_args must start with a vLLM flag, got {args[0]!r}")
        for arg in args:
            # vLLM also reads --max_model_len, --max-model-len=N and --kv-transfer-config.kv_role.
            name = arg.split("=", 1)[0].split(".", 1)[0].replace("_", "-")
            if arg.startswith("--") and name in self.OWNED:
                raise ValueError(f"vLLM argument {name} in engine.vllm_args: kvmem sets it; use {self.OWNED[name]}")
        share = self.gpu_memory_utilization
        if share is not None and not 0 < share <= 1:
            raise ValueError(f"engine.gpu_memory_utilization must be within (0, 1], got {share!r}")
        if self.routing not in self.ROUTINGS:
            raise ValueError(f"engine.routing must be one of {self.ROUTINGS}, got {self.routing!r}")
        for name in ("connect_timeout_s", "reply_timeout_s"):
            if not getattr(self, name) > 0:  # also refuses NaN
                raise ValueError(f"engine.{name} must be a positive number of seconds, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class KVConfig:
    """How fact KV is stored.

    codec: how blobs hold K and V (kv/codec.py): "none" keeps the cache's dtype bit for bit (a
      fact served where it was encoded is exact); "fp8" and "int8" are ~1.9x smaller, "k8v4"
      (int8 keys, int4 values) and "k4v8" (the reverse) ~2.5x, "k7v8" (Hadamard-rotated 7-bit
      keys, int8 values; the lossy codec the numbers support) 2.03x, "int7"/"int6" (rotated)
      2.1x/2.5x, "int4" and "int4h" (rotated) ~3.6x, each decoded at injection (fidelity per
      codec: docs/benchmarks.md).
    hot_cache_mib: the RAM tier: decoded blobs kept in the engine process (LRU), which the
      scheduler fills when it checks a request's blobs, so the forward pass reads them from RAM.
      With a reader KV map on the CPU backend, the worker keeps hot facts' mapped copies within
      the same budget again (connector/mapped_tier.py).
    disk_budget_mib: the disk tier's byte budget for fact blobs (None: unlimited). Past it, the
      blobs of the least-used facts are evicted (kv/budget.py, LFU with dynamic aging); an
      evicted fact is served by text prefill and re-encoded when chats use it enough.
    tenant_quota_mib: the same, per user (None: unlimited); a user past it loses their own
      least-used blobs, never another user's.
    shared_url: a Redis (or Valkey) URL for the shared KV tier (kv/shared.py): every blob written
      is also stored there, a process that lacks a blob locally pulls it from there, and a delete
      removes it there and from every process's local folder. None: the local folder only.
    reader_adapter: "auto" | "off" | a folder: the reader adapter KV-mode chats read injected
      facts with: a KV map the connector applies to the facts' KV at injection, a LoRA vLLM runs
      on the query projections, or both (kvmem/reader/adapters.py; `kvmem tune-reader` trains one).
    text_facts: the last N facts of a KV-mode chat are prefilled as text after the injected ones,
      so they attend to every fact before them as in text prefill (closer to text mode's answer,
      for a fixed cost of N facts' tokens whatever k is; measured in docs/benchmarks.md).
    text_facts_rule: which facts those are: "last" (the latest stored) or "relevant" (the N that
      retrieval scored best, moved after the others).
    recompute: the fraction of each injected fact's tokens the connector computes again, layer by
      layer, over the whole injected cache, so facts attend to the facts before them as in text
      prefill (kv/recompute.py; 0: plain injection, 1: text prefill's KV, computed by the engine's
      own attention kernel on the CPU backend). Off by default: it costs its share of a prefill
      (docs/benchmarks.md, "Fidelity points").
    recompute_rule: which tokens: "deviation" (CacheBlend: those whose layer-1 keys differ most
      from fresh ones), "progressive" (chosen again at every layer), "global" (one budget across
      a chat's facts), "first" or "last" (of each fact); kv/recompute.py says how each chooses.
    fidelity: a named point instead of the three above (kv/fidelity.py): "fast" (plain
      injection), "balanced" (the last 4 facts prefilled as text) or "exact" (every fact token recomputed:
      text prefill's arithmetic and compute). None: the three as set. Setting both is an error.
    """

    codec: str = "none"
    hot_cache_mib: int = 512
    reader_adapter: str = "auto"
    disk_budget_mib: float | None = None
    tenant_quota_mib: float | None = None
    shared_url: str | None = None
    text_facts: int = 0
    text_facts_rule: str = "last"
    recompute: float = 0.0
    recompute_rule: str = "deviation"
    fidelity: str | None = None

    def __post_init__(self) -> None:
        from kvmem.kv.codec_names import check_codec  # not kv.codec: that imports torch
        from kvmem.kv.fidelity import point
        from kvmem.kv.recompute import ENGINE_RULES, Recompute

        check_codec(self.codec)
        Recompute(self.recompute, self.recompute_rule)  # ValueError naming what is wrong
        if self.recompute_rule not in ENGINE_RULES:
            raise ValueError(f"kv.recompute_rule must be one of {ENGINE_RULES}, got {self.recompute_rule!r}")
        # bool is an int to Python, not a count: True must not mean "one fact".
        if not (isinstance(self.text_facts, int) and not isinstance(self.text_facts, bool) and self.text_facts >= 0):
            raise ValueError(f"kv.text_facts must be an int >= 0, got {self.text_facts!r}")
        if self.text_facts_rule not in ("last", "relevant"):
            raise ValueError(f"kv.text_facts_rule must be 'last' or 'relevant', got {self.text_facts_rule!r}")
        if self.fidelity is not None:
            point(self.fidelity)  # ValueError naming the points
            if (self.recompute, self.recompute_rule, self.text_facts) != (0.0, "deviation", 0):
                raise ValueError(f"kv.fidelity {self.fidelity!r} sets kv.recompute, kv.recompute_rule and "
                                 "kv.text_facts itself: set the point or those, not both")
        for name in ("disk_budget_mib", "tenant_quota_mib"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise ValueError(f"kv.{name} must be >= 0 or None (unlimited), got {value!r}")

    @property
    def recompute_setting(self):
        """recompute and recompute_rule (or the fidelity point's) as the one value chats and plans
        carry (kv/recompute.py)."""
        from kvmem.kv.fidelity import point
        from kvmem.kv.recompute import Recompute

        return point(self.fidelity).recompute if self.fidelity else Recompute(self.recompute, self.recompute_rule)

    @property
    def text_facts_setting(self) -> int:
        """text_facts, or the fidelity point's."""
        from kvmem.kv.fidelity import point

        return point(self.fidelity).text_facts if self.fidelity else self.text_facts

    @staticmethod
    def mib_to_bytes(mib: float | None) -> int | None:
        return None if mib is None else int(mib * (1 << 20))


@dataclass(frozen=True)
class PromptConfig:
    """The system message facts are placed into.

    The message is `system_prefix + facts + system_suffix`; the prefix is encoded and injected
    like a fact, so it must be a stable string.
    """

    system_prefix: str = "You are a helpful assistant. You know these facts about the user:\n"
    system_suffix: str = "Answer the user's question briefly, using the facts when they help."
    fact_template: str = "- {text}\n"
    # vLLM's tool parser for replies to chats with tools (as `vllm serve --tool-call-parser`);
    # "hermes" reads what kvmem renders for templates without tool support (engine/tools.py).
    tool_call_parser: str = "hermes"


@dataclass(frozen=True)
class MemoryConfig:
    """The memory layer.

    window: turns of the conversation a turn fact is encoded after (Context-Window Encoding).
    max_fact_tokens: longer facts are refused, not truncated.
    """

    window: int = 2
    max_fact_tokens: int = 256
    trace_chats: int = 32  # chats whose x-ray each scope keeps in memory (trace.py; 0: none)


RETRIEVAL_MODES = ("hybrid", "dense", "lexical")


@dataclass(frozen=True)
class RetrievalConfig:
    """How a query ranks the user's facts.

    mode: "hybrid" fuses the dense (MiniLM cosine) and lexical (BM25) scores of the candidates;
      "dense" or "lexical" uses one. Search scores are the fused score (0-1) in hybrid mode, the
      cosine in dense mode, BM25 in lexical mode.
    depth: candidates taken from each ranking before fusion; on the LoCoMo tuning conversations
      50 and 100 gave the same recall@5/10/20 (within 0.003), and 50 costs less at 10k facts.
    dense_weight: the dense share of the fused score (the lexical one's is 1 - dense_weight);
      on the LoCoMo tuning conversations 0.5-0.6 were within 0.002 of each other on observations
      and 0.55 best with turns stored too (docs/benchmarks.md).
    """

    mode: str = "hybrid"
    depth: int = 50
    dense_weight: float = 0.55

    def __post_init__(self) -> None:
        if self.mode not in RETRIEVAL_MODES:
            raise ValueError(f"retrieval mode must be one of {RETRIEVAL_MODES}, got {self.mode!r}")
        if self.depth < 1 or not 0 <= self.dense_weight <= 1:
            raise ValueError("retrieval depth must be >= 1 and dense_weight within [0, 1]")


@dataclass(frozen=True)
class ExtractConfig:
    """The LLM that `add(..., infer=True)` asks to extract facts and reconcile them (kvmem/extract/).

    url: an OpenAI-compatible API's base URL (".../v1"); None: the served model, through kvmem's
      own engine (text mode, no memory), so inference needs no second model or service.
    model: the model name sent to that API (None: the first its GET /models lists).
    api_key: sent as a Bearer token to that API (None: none sent).
    on_unavailable: what an add with infer=True does when that LLM cannot be reached: "fail"
      (HTTP 503, nothing stored) or "turns" (the messages stored turn by turn, as infer=False
      stores them; the response says so).
    """

    url: str | None = None
    model: str | None = None
    api_key: str | None = None
    on_unavailable: str = "fail"

    def __post_init__(self) -> None:
        if self.on_unavailable not in ON_UNAVAILABLE:
            raise ValueError(f"extract.on_unavailable must be one of {ON_UNAVAILABLE}, got {self.on_unavailable!r}")


ON_UNAVAILABLE = ("fail", "turns")


@dataclass(frozen=True)
class Config:
    home: Path = field(default_factory=default_home)
    models_home: Path | None = None  # where converted models live; default home/models
    kv_root: Path | None = None  # where KV blobs live (e.g. a faster disk); default home/kv
    engine: EngineConfig = EngineConfig()
    kv: KVConfig = KVConfig()
    prompt: PromptConfig = PromptConfig()
    memory: MemoryConfig = MemoryConfig()
    retrieval: RetrievalConfig = RetrievalConfig()
    extract: ExtractConfig = ExtractConfig()
    # PostgreSQL URL for facts, history and vectors (facts/pg.py); None: SQLite in home/facts.sqlite.
    database_url: str | None = None

    @property
    def models_dir(self) -> Path:
        return self.models_home or self.home / "models"

    @property
    def kv_dir(self) -> Path:
        return self.kv_root or self.home / "kv"

    @classmethod
    def from_env(cls, **overrides) -> "Config":
        """Defaults, then KVMEM_* environment variables, then explicit overrides.

        models_home stays None (home/models): the commands' shared models folder is their
        overlay's default (config_overlay.resolve), not the Python API's."""
        values = {key: value for key, (value, _) in env_values(os.environ).items()}
        return replace(cls.from_values(values), **overrides)

    @classmethod
    def from_values(cls, values: Mapping[str, Any]) -> "Config":
        """A Config from flat keys ("home", "engine.model", ...: `keys()`); the others keep their
        defaults. Each section is built once, from its final values, so its own checks judge what
        will be used rather than a half-applied mix."""
        top: dict[str, Any] = {}
        sections: dict[str, dict[str, Any]] = {}
        for key, value in values.items():
            section, _, name = key.rpartition(".")
            (sections.setdefault(section, {}) if section else top)[name] = value
        try:
            built = {name: SECTIONS[name](**given) for name, given in sections.items()}
            return cls(**top, **built)
        except KvmemError:
            raise  # typed already (an unknown codec is an InvalidInputError, as callers expect)
        except (TypeError, ValueError) as e:  # an unknown key, a value out of range
            raise ConfigError(str(e)) from e


SECTIONS: dict[str, type] = {f.name: type(f.default) for f in dataclasses.fields(Config)
                             if dataclasses.is_dataclass(f.default)}
PATHS = ("home", "models_home", "kv_root")  # the keys whose values are folders


def keys() -> tuple[str, ...]:
    """Every setting's flat key, in Config's field order: "home", ..., "engine.model", ..."""
    out: list[str] = []
    for f in dataclasses.fields(Config):
        if f.name in SECTIONS:
            out += [f"{f.name}.{g.name}" for g in dataclasses.fields(SECTIONS[f.name])]
        else:
            out.append(f.name)
    return tuple(out)


def flatten(config: Config) -> dict[str, Any]:
    """{flat key: value} of a Config, the inverse of Config.from_values."""
    out: dict[str, Any] = {}
    for key in keys():
        section, _, name = key.rpartition(".")
        out[key] = getattr(getattr(config, section) if section else config, name)
    return out
