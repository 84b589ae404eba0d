"""What the memory API returns."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmem.encoding import EncodeReport


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
