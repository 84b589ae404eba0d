"""Prompt assembly from separately tokenized segments.

A chat prompt with facts is laid out as

    [head][fact_1]...[fact_k][tail]

head = the chat template's opening up to and including the system prefix text;
fact_i = one fact rendered with the fact template; tail = the rest of the system message, the
conversation and the generation prompt. Each piece is tokenized on its own, so a fact's tokens
are the same wherever it is placed, at encoding and at serving: that is what lets its stored KV
stand in for its text. The split points come from rendering the model's own chat template with a
marker, so any template works.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

from kvmem.config import PromptConfig
from kvmem.connector.plan import Segment
from kvmem.engine.tools import Tools, template_turns
from kvmem.errors import InvalidInputError

_FACT_CACHE = 100_000  # fact texts whose tokens are remembered (~1 KB each at most)


@dataclass(frozen=True)
class Prompt:
    token_ids: tuple[int, ...]
    segments: tuple[Segment, ...]  # head first, then facts, contiguous from token 0

    @property
    def memory_tokens(self) -> int:
        return self.segments[-1].end if self.segments else 0


class PromptBuilder:
    def __init__(self, tokenizer, config: PromptConfig = PromptConfig()) -> None:
        self.tokenizer = tokenizer
        self.config = config
        head, _ = self._split([{"role": "user", "content": "?"}])
        self._head_text = head
        self.head_ids = tuple(self._tokens(head))
        self.head_id = "sys-" + hashlib.sha256(repr(self.head_ids).encode()).hexdigest()[:20]
        # No token spells more characters than this: a text of n characters has >= n / it tokens.
        self.max_token_chars = max(map(len, tokenizer.get_vocab()), default=1)
        self._fact_cache: dict[str, tuple[int, ...]] = {}
        self._native_tools: bool | None = None  # the template renders tools after the head (found once)

    def fact_tokens(self, text: str) -> tuple[int, ...]:
        return self.fact_tokens_many([text])[0]

    def fact_tokens_many(self, texts: list[str]) -> list[tuple[int, ...]]:
        """Each fact's tokens. Remembered per text (a chat with k=100 facts spent ~20 ms
        tokenizing them one call at a time); the ones not seen yet go to the tokenizer in one call."""
        for text in texts:
            if not isinstance(text, str) or not text.strip():
                raise InvalidInputError("a fact must be a non-empty string", param="facts")
        missing = list(dict.fromkeys(t for t in texts if t not in self._fact_cache))
        if missing:
            rendered = [self.config.fact_template.format(text=t.strip()) for t in missing]
            for text, ids in zip(missing, self.tokenizer(rendered, add_special_tokens=False)["input_ids"]):
                self._remember_fact(text, tuple(ids))
        return [self._fact_cache[t] for t in texts]

    def _remember_fact(self, text: str, ids: tuple[int, ...]) -> None:
        if len(self._fact_cache) >= _FACT_CACHE:
            self._fact_cache.pop(next(iter(self._fact_cache)))  # oldest first: dicts keep insertion order
        self._fact_cache[text] = ids

    def context_tokens(self, text: str) -> tuple[int, ...]:
        return tuple(self._tokens(text)) if text else ()

    def chat(self, facts: list[tuple[str, tuple[int, ...]]], messages: list[dict], tools: Tools | None = None) -> Prompt:
        """facts: (fact id, fact tokens) in the order they go into the prompt; tools go in the tail."""
        _, tail = self._split(messages, tools)
        ids = list(self.head_ids)
        segments = [Segment(self.head_id, 0, len(ids))]
        for fact_id, tokens in facts:
            segments.append(Segment(fact_id, len(ids), len(tokens)))
            ids.extend(tokens)
        ids.extend(self._tokens(tail))
        return Prompt(tuple(ids), tuple(segments))

    def encoding(self, fact_id: str, fact: tuple[int, ...], context: tuple[int, ...] = ()) -> Prompt:
        """[head][context][fact]: the fact's KV is computed after its context window."""
        ids = (*self.head_ids, *context, *fact)
        return Prompt(ids, (Segment(fact_id, len(self.head_ids) + len(context), len(fact)),))

    def head_encoding(self) -> Prompt:
        return Prompt(self.head_ids, (Segment(self.head_id, 0, len(self.head_ids)),))

    def _split(self, messages: list[dict], tools: Tools | None = None) -> tuple[str, str]:
        _check_messages(messages)
        if tools is None and not any(_tool_turn(m) for m in messages):
            return self._render(messages, "", None)
        if self.native_tools():
            head, tail = self._render(template_turns(messages, True), "", [dict(s) for s in tools.specs] if tools else None)
            if head == self._head_text:
                return head, tail
        return self._render(template_turns(messages, False), tools.system_block() if tools else "", None)

    def native_tools(self) -> bool:
        """Whether the chat template renders tool definitions itself, after the head: then its
        rendering is used; else kvmem's (engine/tools.py), so the head and its KV never change."""
        if self._native_tools is None:
            probe = [{"type": "function", "function": {"name": "kvmem_probe_tool", "parameters": {"type": "object"}}}]
            turns = [{"role": "user", "content": "?"}]
            head, tail = self._render(turns, "", None)
            try:
                with_head, with_tail = self._render(turns, "", probe)
            except Exception:  # noqa: BLE001 - a template that fails on tools does not render them
                with_head, with_tail = head, tail
            self._native_tools = with_head == head and "kvmem_probe_tool" in with_tail
        return self._native_tools

    def _render(self, turns: list[dict], extra: str, tools: list | None) -> tuple[str, str]:
        # A fresh random marker per call: user text cannot contain it, so it cannot move the split.
        mark = f"\x00KVMEM-FACTS-{secrets.token_hex(16)}\x00"
        system = {"role": "system", "content": self.config.system_prefix + mark + self.config.system_suffix + extra}
        from jinja2 import TemplateError

        try:
            text = self.tokenizer.apply_chat_template([system, *turns], tools=tools, tokenize=False,
                                                      add_generation_prompt=True)
        except TemplateError as e:  # the model's template refuses this conversation (raise_exception)
            raise InvalidInputError(f"the model's chat template refused the messages: {e}", param="messages") from None
        head, found, tail = text.partition(mark)
        if not found or mark in tail:
            raise RuntimeError("the chat template must render the system message exactly once")
        return head, tail

    def _tokens(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


def _check_messages(messages: list[dict]) -> None:
    if not messages:
        raise InvalidInputError("a chat needs at least one message", param="messages")
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "tool") or not isinstance(m.get("content"), str):
            raise InvalidInputError(f"messages must be {{'role': 'user'|'assistant'|'tool', 'content': str}}, got {m!r}",
                                    param="messages")


def _tool_turn(m: dict) -> bool:
    return m.get("role") == "tool" or bool(m.get("tool_calls"))
