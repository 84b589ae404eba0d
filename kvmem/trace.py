"""The chat x-ray: what each recent chat retrieved, injected as KV, prefilled as text and why.

Kept in memory only, in a bounded ring per scope (user id), with a bound on the number of
scopes too (the least recently used scope goes first), so 10k chats or 10k users cost no more
than the bounds allow. A trace holds only its own scope's data: its facts are the ones that
chat read, and it is looked up by its id and then checked against the caller's scope.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field

_TEXT = 200  # characters of a question or fact kept in a trace


@dataclass(frozen=True)
class FactTrace:
    id: str
    text: str  # the first 200 characters
    score: float | None  # retrieval's score; None when the chat named its facts
    served: str  # "kv": injected from its blob; "text": prefilled as text
    reason: str | None  # why text: missing / corrupt / stale / mismatch (its blob), text_facts (asked),
    #                     after_text (behind a fact served as text: only a prefix is injected), mode (text mode)
    tokens: int


@dataclass(frozen=True)
class ChatTrace:
    id: str
    user_id: str
    agent_id: str | None
    run_id: str | None
    created_at: float
    mode: str
    question: str
    facts: tuple[FactTrace, ...]
    prompt_tokens: int
    injected_tokens: int  # prompt tokens written from blobs: the text prefill saved
    ttft_ms: float
    retrieval_ms: float
    fallbacks: dict[str, int] = field(default_factory=dict)  # reason -> facts served as text for it

    def to_dict(self) -> dict:
        return {"id": self.id, "user_id": self.user_id, "agent_id": self.agent_id, "run_id": self.run_id,
                "created_at": self.created_at, "mode": self.mode, "question": self.question,
                "facts": [vars(f) for f in self.facts], "prompt_tokens": self.prompt_tokens,
                "injected_tokens": self.injected_tokens, "prefill_tokens_saved": self.injected_tokens,
                "ttft_ms": self.ttft_ms, "retrieval_ms": self.retrieval_ms, "fallbacks": dict(self.fallbacks)}


class TraceRing:
    """The last `per_scope` traces of each of at most `scopes` scopes (0: keep none)."""

    def __init__(self, per_scope: int = 32, scopes: int = 1024) -> None:
        self.per_scope, self.scopes = per_scope, scopes
        self._rings: OrderedDict[str, deque[ChatTrace]] = OrderedDict()
        self._by_id: dict[str, ChatTrace] = {}  # every kept trace: get() is asked after every chat
        self._lock = threading.Lock()

    def record(self, trace: ChatTrace) -> None:
        if self.per_scope <= 0 or self.scopes <= 0:
            return
        with self._lock:
            ring = self._rings.pop(trace.user_id, None) or deque()
            ring.append(trace)
            self._by_id[trace.id] = trace
            if len(ring) > self.per_scope:
                self._by_id.pop(ring.popleft().id, None)
            self._rings[trace.user_id] = ring  # most recently used last
            while len(self._rings) > self.scopes:
                for old in self._rings.popitem(last=False)[1]:
                    self._by_id.pop(old.id, None)

    def get(self, trace_id: str) -> ChatTrace | None:
        with self._lock:
            return self._by_id.get(trace_id)

    def recent(self, user_id: str) -> list[ChatTrace]:
        """The scope's traces, newest first."""
        with self._lock:
            return list(reversed(self._rings.get(user_id, ())))

    def __len__(self) -> int:
        with self._lock:
            return sum(len(r) for r in self._rings.values())


def clip(text: str) -> str:
    return text if len(text) <= _TEXT else text[: _TEXT - 1] + "…"


def served(fact_ids: list[str], mode: str, planned: int, from_blobs: int, fallbacks: dict) -> list[tuple[str, str | None]]:
    """How each fact of a chat (prompt order) reached the model: ("kv", None) or ("text", reason).
    `planned`: facts the plan asked to inject (the rest were text_facts); `from_blobs`: facts the
    connector injected, always a prefix of the prompt."""
    out = []
    for i, fact_id in enumerate(fact_ids):
        if mode != "kv":
            out.append(("text", "mode"))
        elif i < from_blobs:
            out.append(("kv", None))
        elif fact_id in fallbacks:
            out.append(("text", fallbacks[fact_id]))
        else:
            out.append(("text", "text_facts" if i >= planned else "after_text"))
    return out
