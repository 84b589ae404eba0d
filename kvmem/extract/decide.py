"""Reading the LLM's replies: extracted facts, and per fact one decision ADD / UPDATE / DELETE / NONE.

A reply is untrusted even under a schema (an external endpoint may ignore it): whatever does not
parse, names an id that was not shown, or repeats a fact or a memory already decided is dropped
and logged, and the rest stands. Ids are resolved through the aliases of this call only, and
each alias stands for a fact of the add's own scope, so a hallucinated id can only be refused.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from kvmem.extract.prompts import EVENTS, MAX_FACT_CHARS, MAX_FACTS

log = logging.getLogger("kvmem.extract")


@dataclass(frozen=True)
class Decision:
    """What to do with new fact number `fact`; `target`: the real id of the stored fact an
    UPDATE or DELETE is about (None for ADD and NONE)."""

    fact: int
    event: str
    target: str | None = None


def parse_facts(reply: str) -> list[str]:
    """The extraction reply's facts, stripped, de-duplicated, bounded; [] (logged) if it does not parse."""
    facts = _json_list(reply, "facts", "extraction")
    out: list[str] = []
    for fact in facts:
        text = fact.strip()[:MAX_FACT_CHARS] if isinstance(fact, str) else ""
        if text and text not in out:
            out.append(text)
    return out[:MAX_FACTS]


def _json_list(reply: str, key: str, what: str) -> list:
    """reply's JSON object's list under `key`; [] (logged) when the reply is not that."""
    try:
        items = json.loads(reply)[key]
        if not isinstance(items, list):
            raise TypeError(f"{key} is not a list")
    except (ValueError, KeyError, TypeError) as e:
        log.warning("%s reply dropped (%s): %.200r", what, e, reply)
        return []
    return items


def aliases(candidates: list[str]) -> dict[str, str]:
    """alias ("0", "1", ...) -> real fact id, for the stored facts shown to the model."""
    return {str(i): fact_id for i, fact_id in enumerate(candidates)}


def parse_decisions(reply: str, n_facts: int, shown: dict[str, str]) -> list[Decision]:
    """The reconciliation reply as Decisions; each bad entry dropped and logged, the rest kept."""
    entries = _json_list(reply, "decisions", "reconciliation")
    out: list[Decision] = []
    for entry in entries:
        decision = _decision(entry, n_facts, shown)
        if decision is None:
            log.warning("reconciliation decision dropped: %.200r", entry)
        elif any(d.fact == decision.fact or (decision.target and d.target == decision.target) for d in out):
            log.warning("reconciliation decision dropped (fact or memory already decided): %.200r", entry)
        else:
            out.append(decision)
    return out


def _decision(entry: object, n_facts: int, shown: dict[str, str]) -> Decision | None:
    if not isinstance(entry, dict):
        return None
    fact, event, alias = entry.get("fact"), entry.get("event"), entry.get("id")
    if isinstance(fact, bool) or not isinstance(fact, int) or not 0 <= fact < n_facts or event not in EVENTS:
        return None
    if event in ("ADD", "NONE"):
        return Decision(fact, event)
    target = shown.get(alias) if isinstance(alias, str) else None
    return None if target is None else Decision(fact, event, target)
