"""What the memory API returns.

Plain records that import nothing from kvmem, so any layer can return them without importing
the layers above it (EncodeReport lives here, not beside the Encoder that makes it, for that)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class EncodeReport:
    encoded: int
    failed: tuple[str, ...]
    seconds: float


@dataclass(frozen=True)
class SearchHit:
    id: str
    text: str
    score: float  # higher is more relevant: cosine (dense ranking), fused rank score (hybrid), BM25 (lexical)
    metadata: dict
    created_at: float
    kv_status: str


@dataclass(frozen=True)
class AddResult:
    ids: tuple[str, ...]  # every fact of the call, new or already stored
    created: int
    duplicates: int
    encode: EncodeReport | None  # None when encoding was left to the background
    new_ids: tuple[str, ...] = ()  # of `ids`, those this call stored

    def events(self, repeat: str = "NONE") -> list[tuple[str, str]]:
        """(id, event) per id of the call, in order, as Mem0 reports an add: "ADD" for the first
        mention of a fact this call stored, `repeat` for the rest (Mem0's NONE; kvmem's own
        route says NOOP)."""
        new, out = set(self.new_ids), []
        for fact_id in self.ids:
            out.append((fact_id, "ADD" if fact_id in new else repeat))
            new.discard(fact_id)
        return out


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token with its logprob and the most likely alternatives there (best first)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob) of the top-n at this step (KVMem.token_texts)


@dataclass(frozen=True)
class ToolCall:
    """A function call read out of a reply (engine/tools.py)."""

    id: str
    name: str
    arguments: str  # JSON text, as OpenAI carries it


@dataclass(frozen=True)
class ToolCallDelta:
    """A streamed chat's tool call (sent whole once the reply is read: see Chats.stream)."""

    index: int  # the choice
    position: int  # the call's place among the choice's calls
    call: ToolCall


@dataclass(frozen=True)
class Choice:
    """One of a chat's n answers (each read the same prompt: in KV mode, the same injected facts)."""

    index: int
    answer: str
    token_ids: tuple[int, ...]
    finish_reason: str  # "stop" (end of text or a stop sequence/token), "length" (max_tokens) or "tool_calls"
    logprobs: tuple[TokenLogprob, ...] | None = None  # per generated token, when asked for
    tool_calls: tuple[ToolCall, ...] = ()  # when the chat had tools and the reply called them
    content: str | None = None  # the reply less its tool calls (None: all of it was calls); set with tool_calls


@dataclass(frozen=True)
class ChatResult:
    answer: str
    mode: str
    fact_ids: tuple[str, ...]  # facts placed in the prompt, in prompt order
    ttft_s: float
    latency_s: float
    prompt_tokens: int
    injected_tokens: int  # tokens the connector wrote from blobs (0 in text mode)
    cached_tokens: int  # tokens served by vLLM's own prefix cache
    fallbacks: int  # facts served as text because their blob was missing/corrupt/stale
    fallback_reasons: dict[str, str] = field(default_factory=dict)
    retrieval_s: float = 0.0
    token_ids: tuple[int, ...] = ()
    first_logprobs: dict[int, float] = field(default_factory=dict)
    reader_adapter: bool = False  # the engine read this chat with the reader adapter (KV mode only)
    choices: tuple[Choice, ...] = ()  # every answer, the first being `answer`/`token_ids` above
    stored: tuple[str, ...] = ()  # fact ids the chat's write-back stored (ChatArgs.store)
    trace_id: str = ""  # its x-ray (KVMem.trace; GET /v1/chats/{id}/trace)
    recomputed_tokens: int = 0  # injected fact tokens the connector recomputed (kv.recompute)
    assembly_s: float = 0.0  # before the engine, after retrieval: the prompt's tokens and the plan
    # The engine-side injection's milliseconds by stage (connector/profile.py; KV mode only).
    connector_ms: dict[str, float] = field(default_factory=dict)

    @property
    def finish_reason(self) -> str:
        return self.choices[0].finish_reason if self.choices else "stop"


@dataclass(frozen=True)
class MemoryStatus:
    """KVMem.status(): what /health, /metrics and the CLI show, read in one place."""

    facts: int  # stored, all users
    encode_queue: int  # facts waiting for their KV
    kv_bytes: int  # KV blobs on disk
    tiers: dict  # KVMem.kv_tiers()
    engine: Any  # engine.protocol.EngineStatus; None when opened without an engine
    fact_encodes: int = 0  # facts this process sent to the engine to encode (each under its lease)
