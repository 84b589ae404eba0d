"""What kvmem asks of an engine, and what it gets back: one interface for the in-process engine
(llm.LocalEngine, vLLM in this process) and the remote one (remote.RemoteEngine, `kvmem
replica` servers over HTTP). The service, the server and the CLI use only this.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Protocol, runtime_checkable

from kvmem.connector.plan import InjectionReport, Plan
from kvmem.engine.sampling import Sampling
from kvmem.model import ModelInfo
from kvmem.results import TokenLogprob

BLOB_WAIT_S = 30.0  # an encode's blob write takes milliseconds; only a failed one waits this long


@dataclass(frozen=True)
class EngineRequest:
    token_ids: tuple[int, ...]
    salt: str  # vLLM cache_salt: prefix-cache blocks are shared only between equal salts
    max_tokens: int = 64
    plan: Plan | None = None
    logprobs: int | None = None  # top-n logprobs per generated token
    score_last: int = 0  # >0: return the logprobs of the last n prompt tokens (teacher forcing)
    reader: bool = False  # read with the reader adapter (KV-mode chats), where the engine has one
    route: str = ""  # whose request (the user): a RemoteEngine sends a user's requests to one replica
    sampling: Sampling = Sampling()  # greedy unless the caller asks otherwise


@dataclass(frozen=True)
class Completion:
    """One of a request's n completions."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str  # "stop" or "length"
    logprobs: tuple[TokenLogprob, ...] | None = None  # per generated token, when the request asked for logprobs


@dataclass(frozen=True)
class ChoiceDelta:
    """What a stream of n > 1 completions yields: new text of one of them (n = 1 yields str)."""

    index: int
    text: str


@dataclass(frozen=True)
class EngineResult:
    token_ids: tuple[int, ...]
    text: str
    ttft_s: float
    latency_s: float
    prompt_tokens: int
    cached_tokens: int  # prompt tokens not prefilled: vLLM prefix-cache hits plus injected ones
    injection: InjectionReport | None = None  # the connector's report (inject requests it answered)
    first_logprobs: dict[int, float] = field(default_factory=dict)
    scored: tuple[float, ...] = ()  # logprob of each of the last `score_last` prompt tokens
    adapter: bool = False  # read with the reader adapter: vLLM ran its LoRA, or the connector its KV map
    choices: tuple[Completion, ...] = ()  # all n completions; token_ids and text above are the first's


@dataclass(frozen=True)
class EngineStatus:
    """An engine at a glance, for /health, /metrics and the CLI."""

    kind: str  # "local" (vLLM in this process) or "remote" (replicas)
    healthy: bool  # can take requests now (remote: at least one replica is up)
    reader_adapter: str | None  # the reader adapter it reads KV-mode chats with, if any
    aborted: int  # requests dropped because their caller went away
    replicas_up: tuple[str, ...] = ()  # remote only
    replicas_down: tuple[str, ...] = ()
    failovers: int = 0  # remote only: requests sent to a user's second (or later) replica
    # remote only: (replica, whether it was the user's first choice) -> requests it answered
    answered: tuple[tuple[str, bool, int], ...] = ()


@runtime_checkable
class Engine(Protocol):
    """An engine that runs kvmem's requests: chats (maybe injecting), encodes and scoring."""

    model: ModelInfo
    reader_adapter: Path | str | None

    def run(self, requests: list[EngineRequest], cancel: threading.Event | None = None) -> list[EngineResult]:
        """Run all at once (batched) and wait; `cancel` aborts the unfinished ones and raises
        RequestCancelled."""

    def stream(self, request: EngineRequest, cancel: threading.Event | None = None) -> Iterator[str | EngineResult]:
        """Text deltas as they are generated, then the EngineResult; closing it aborts."""

    def encode(self, requests: list[EngineRequest]) -> None:
        """Run ENCODE requests; returns once their blobs are written (or their wait ran out)."""

    def health(self) -> bool:
        """Whether it can take requests now."""

    def status(self) -> EngineStatus:
        ...

    def reset_prefix_cache(self) -> bool:
        """Drop vLLM's own prefix cache (benchmarks); False where it was refused."""

    def close(self) -> None:
        ...
