"""`add(messages, infer=True)`: Mem0's write path, an LLM's facts reconciled with what is stored.

1. One schema-constrained LLM call extracts short self-contained facts from the conversation
   (relative dates resolved against the messages' timestamps).
2. For each, the most similar stored facts of the same scope (user, agent and run all equal) are
   retrieved; a second schema-constrained call decides per new fact ADD / UPDATE(id) /
   DELETE(id) / NONE, seeing those facts under aliases only (decide.py).
3. The decisions are applied all or nothing (writes.apply_changes): new and updated facts keep
   the message they came from as `origin` and are encoded; deleted ones are forgotten fully.

Nothing is stored before both calls have answered, so an LLM that is down (ExtractorUnavailable,
HTTP 503) leaves the store as it was. With no similar fact stored there is nothing to reconcile:
every fact is an ADD and the second call is skipped.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from kvmem.errors import InvalidInputError
from kvmem.extract import prompts
from kvmem.extract.decide import Decision, aliases, parse_decisions, parse_facts
from kvmem.extract.llm import LLM, ExtractorUnavailable
from kvmem.facts.inputs import iso_or_none, timestamp_of, with_timestamp
from kvmem.facts.messages import check_messages, turn_text
from kvmem.facts.scope import Scope
from kvmem.results import EncodeReport
from kvmem.retrieval import Retrieval
from kvmem.writes import Change, Changed, Writes, apply_changes

log = logging.getLogger("kvmem.extract")
SIMILAR = 5  # stored facts retrieved per new fact, as Mem0 does
MAX_SHOWN = 20  # stored facts shown to the model in all: its prompt stays small


@dataclass(frozen=True)
class InferResult:
    """What an add with infer=True did: each fact with its event (Mem0's ADD, UPDATE, DELETE, NONE)."""

    results: tuple[Changed, ...]
    encode: EncodeReport | None  # None when encoding was left to the background
    stored_as_turns: bool = False  # the LLM was down and [extract] on_unavailable = "turns" stored the messages

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(c.id for c in self.results)

    def as_mem0(self) -> dict:
        return {"results": [c.as_mem0() for c in self.results]}


class Inferrer:
    def __init__(self, llm: LLM, retrieval: Retrieval, facts, writes: Writes, on_unavailable: str = "fail") -> None:
        self.llm, self.retrieval, self.facts, self.writes = llm, retrieval, facts, writes
        self.on_unavailable = on_unavailable  # ExtractConfig.on_unavailable

    def add(self, messages, scope: Scope, *, facts=None, metadata=None, context: str = "", window=None,
            encode: str = "background", timestamp=None, origin: str = "", expiration_date=None) -> InferResult:
        """Writes.add's arguments; those that only apply to facts given as they are (`facts`,
        `context`, `origin`) are refused, `window` is ignored (no turn is stored), and `timestamp`
        is the conversation's date when its messages carry none."""
        messages = _conversation(messages, facts, context, origin, timestamp_of(timestamp))
        if metadata is not None and not isinstance(metadata, dict):
            raise InvalidInputError(f"metadata must be a dict, got {type(metadata).__name__}", param="metadata")
        try:
            new = self.extract(messages, scope)
            return self.apply(new, messages, scope, metadata=metadata, encode=encode, expiration_date=expiration_date)
        except ExtractorUnavailable:
            # Raised before anything was stored (both calls come before apply_changes writes).
            if self.on_unavailable != "turns":
                raise
            log.warning("extraction LLM unavailable: the %d messages stored turn by turn (on_unavailable = turns)",
                        len(messages))
            return self.as_turns(messages, scope, metadata, window, encode, expiration_date)

    def as_turns(self, messages: list[dict], scope: Scope, metadata, window, encode: str,
                 expiration_date) -> InferResult:
        """The messages stored as add(infer=False) stores them, reported in Mem0's terms: ADD for
        a turn stored now, NONE for one the scope already held."""
        added = self.writes.add(messages, scope, facts=None, metadata=metadata, context="", window=window,
                                encode=encode, timestamp=None, origin="", expiration_date=expiration_date)
        results = tuple(Changed(i, self.facts.get(i).text, event) for i, event in added.events("NONE"))
        return InferResult(results, added.encode, stored_as_turns=True)

    def apply(self, new: list[str], messages: list[dict], scope: Scope, *, reconcile: bool = True,
              metadata=None, encode: str = "background", expiration_date=None) -> InferResult:
        """Store the facts `new` extracted from `messages`: reconciled with the scope's similar
        facts (Mem0's), or with reconcile=False all added (the eval's baseline: one extraction,
        applied both ways, isolates what reconciliation does)."""
        if not new:
            return InferResult((), None)
        shown = self.similar(new, scope) if reconcile else []
        decisions = self.decide(new, shown, scope) if shown else [Decision(i, "ADD") for i in range(len(new))]
        changes = changes_of(decisions, new, messages, metadata)
        results, report = apply_changes(self.writes, changes, scope, encode=encode, expiration_date=expiration_date)
        return InferResult(tuple(results), report)

    def extract(self, messages: list[dict], scope: Scope) -> list[str]:
        schema = prompts.facts_schema()
        reply = self.llm.complete(prompts.extraction_messages(messages), schema, name="facts",
                                  max_tokens=prompts.max_tokens_for(schema), user_id=scope.user_id)
        return parse_facts(reply)

    def similar(self, new: list[str], scope: Scope) -> list[tuple[str, str]]:
        """(fact id, text) of the stored facts most like the new ones, of exactly this scope."""
        shown: dict[str, str] = {}
        for text in new:
            for hit in self.retrieval.search(text, user_id=scope.user_id, agent_id=scope.agent_id,
                                             run_id=scope.run_id, k=SIMILAR):
                if hit.id not in shown and len(shown) < MAX_SHOWN and self._in_scope(hit.id, scope):
                    shown[hit.id] = hit.text
        return list(shown.items())

    def _in_scope(self, fact_id: str, scope: Scope) -> bool:
        # A search by user id alone also finds the user's agent- and run-scoped facts: an infer
        # of one scope must never rewrite another's.
        try:
            return self.facts.get(fact_id).scope.key == scope.key
        except KeyError:
            return False  # deleted since the search

    def decide(self, new: list[str], shown: list[tuple[str, str]], scope: Scope) -> list[Decision]:
        named = aliases([fact_id for fact_id, _ in shown])
        schema = prompts.decisions_schema(len(new), list(named))
        messages = prompts.reconcile_messages(new, [(alias, text) for alias, (_, text) in zip(named, shown)])
        reply = self.llm.complete(messages, schema, name="decisions", max_tokens=prompts.max_tokens_for(schema),
                                  user_id=scope.user_id)
        decisions = parse_decisions(reply, len(new), named)
        undecided = set(range(len(new))) - {d.fact for d in decisions}
        if undecided:
            log.warning("no decision for new facts %s: not stored", sorted(undecided))
        return decisions


def changes_of(decisions: list[Decision], new: list[str], messages: list[dict], metadata: dict | None) -> list[Change]:
    """The store changes the decisions stand for (NONE changes nothing), each new text with the
    message it came from as origin, and that message's timestamp."""
    out = []
    for d in sorted(decisions, key=lambda d: d.fact):
        if d.event == "NONE":
            continue
        if d.event == "DELETE":
            out.append(Change("DELETE", fact_id=d.target))
            continue
        source = origin_of(new[d.fact], messages)
        stamp = source.get("timestamp")
        out.append(Change(d.event, new[d.fact], d.target, turn_text(source), with_timestamp(metadata, stamp),
                          iso_or_none(stamp)))
    return out


def origin_of(fact: str, messages: list[dict]) -> dict:
    """The message a fact most likely came from: the one sharing most of its words (the model
    is not asked which: a small one would guess), the last user message on a tie."""
    words = _words(fact)
    said = [m for m in messages if m["content"].strip()]
    ranked = sorted(enumerate(said), key=lambda im: (len(words & _words(im[1]["content"])),
                                                     im[1]["role"] == "user", im[0]))
    return ranked[-1][1]


def _words(text: str) -> set[str]:
    return set(re.findall(r"\w+", text.lower()))


def _conversation(messages, facts, context: str, origin: str, stamp: str | None) -> list[dict]:
    for name, value in (("facts", facts), ("context", context), ("origin", origin)):
        if value:
            raise InvalidInputError(f"{name} does not apply with infer=True: the facts are extracted from "
                                    "messages", param=name)
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    check_messages(messages)
    if not any(m["content"].strip() for m in messages):
        raise InvalidInputError("messages hold no text to extract facts from", param="messages")
    return [m if m.get("timestamp") or not stamp else {**m, "timestamp": stamp} for m in messages]
