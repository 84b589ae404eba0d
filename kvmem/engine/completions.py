"""A replica's /v1/completions replies read into kvmem's types: whole (`completion`) or streamed
(`Streamed`, which collects server-sent chunks per choice). The replica returns tokens as
"token_id:<n>" (vLLM's --return-tokens-as-token-ids), since the gateway tokenizes.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx

from kvmem.engine.protocol import Completion
from kvmem.errors import RequestCancelled
from kvmem.results import TokenLogprob


@dataclass
class Streamed:
    """What a streamed completion has sent so far, per completion index."""

    text: dict[int, list[str]] = field(default_factory=dict)
    chunks: dict[int, list[dict]] = field(default_factory=dict)  # each choice's chunks, for ids and logprobs
    finish: dict[int, str] = field(default_factory=dict)
    usage: dict = field(default_factory=dict)
    first: float | None = None  # when the first token arrived

    def deltas(self, response: httpx.Response, cancel: threading.Event | None) -> Iterator[tuple[int, str]]:
        for line in response.iter_lines():
            if cancel is not None and cancel.is_set():
                raise RequestCancelled("the stream was cancelled before it finished")
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            self.usage = chunk.get("usage") or self.usage
            for choice in chunk.get("choices", []):
                self.first = self.first or time.perf_counter()
                index = choice.get("index", 0)
                self.chunks.setdefault(index, []).append(choice)
                if choice.get("finish_reason"):
                    self.finish[index] = choice["finish_reason"]
                if choice.get("text"):
                    self.text.setdefault(index, []).append(choice["text"])
                    yield index, choice["text"]

    def completions(self, top_n: int | None) -> tuple[Completion, ...]:
        indexes = sorted(set(self.chunks) | {0})
        return tuple(completion(_merged(i, self.chunks.get(i, []), "".join(self.text.get(i, [])),
                                         self.finish.get(i)), top_n) for i in indexes)


def _merged(index: int, chunks: list[dict], text: str, finish: str | None) -> dict:
    """A streamed choice's chunks as one completions choice."""
    logprobs = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
    for c in chunks:
        for key in logprobs:
            logprobs[key] += (c.get("logprobs") or {}).get(key) or []
    return {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}


def completion(choice: dict, top_n: int | None) -> Completion:
    """A completions-API choice -> ours (tokens come as "token_id:<n>": --return-tokens-as-token-ids)."""
    ids = tuple(_token_ids(choice))
    logprobs = None
    if top_n is not None:
        raw = choice.get("logprobs") or {}
        steps = zip(ids, raw.get("token_logprobs") or [], raw.get("top_logprobs") or [])
        logprobs = tuple(TokenLogprob(t, lp, _top(top or {}, top_n)) for t, lp, top in steps)
    reason = choice.get("finish_reason")
    return Completion(choice.get("index", 0), choice.get("text", ""), ids, reason if reason in ("stop", "length")
                      else "stop", logprobs)


def _top(top: dict, n: int) -> tuple[tuple[int, float], ...]:
    return tuple(sorted(((token_id(t), lp) for t, lp in top.items()), key=lambda e: -e[1]))[:n]


def _token_ids(choice: dict) -> list[int]:
    """Sampled token ids: the replica returns tokens as "token_id:<n>" (--return-tokens-as-token-ids)."""
    return [token_id(t) for t in (choice.get("logprobs") or {}).get("tokens") or []]


def token_id(token: str) -> int:
    return int(token.removeprefix("token_id:"))


def cached_tokens(usage: dict) -> int:
    return ((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
