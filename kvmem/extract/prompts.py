"""The two prompts of `add(..., infer=True)` and the JSON schemas their replies are held to.

Both replies are decoded under a JSON schema (vLLM structured outputs, or an OpenAI-compatible
API's `response_format`), so even the bundled 135M model answers something parseable; the
bounds in the schemas (items, string lengths) are what keep a small model from rambling until
max_tokens cuts its JSON in half. Ids shown to the model are aliases ("0", "1", ...): a model
never sees, so can never name, a real fact id (decide.py maps them back).
"""

from __future__ import annotations

import json
from datetime import datetime, timezone

from kvmem.facts.messages import dated, turn_text

MAX_FACTS = 6  # facts one add may extract
MAX_FACT_CHARS = 160  # a fact is a sentence, not a paragraph
EVENTS = ("ADD", "UPDATE", "DELETE", "NONE")

EXTRACT_SYSTEM = """You extract facts worth remembering about the user from a conversation.
Today is {today}. Each message starts with the date it was sent, when known.
Rules:
- Write each fact as one short sentence that makes sense on its own (name people and things; no "he", "it").
- Turn relative dates ("yesterday", "last week", "next Friday") into calendar dates, counted from the
  date of the message they were said in.
- Keep preferences, plans, relationships, events, places, jobs, health, possessions.
- Skip greetings, small talk and anything the assistant says that the user did not confirm.
- If there is nothing worth remembering, return an empty list.
Reply with JSON only: {{"facts": ["...", "..."]}}"""

RECONCILE_SYSTEM = """You keep a user's memory up to date.
You are given the memories already stored (each with an id) and new facts (each with a number).
For each new fact, decide one event:
- ADD: the fact is new information; store it.
- UPDATE: the fact corrects or adds detail to the memory with this id; that memory becomes the fact.
- DELETE: the fact contradicts the memory with this id (it is no longer true); forget that memory.
- NONE: the memory already says the same thing; change nothing.
Use only ids from the stored memories. For ADD and NONE, give "id": "".
Reply with JSON only: {"decisions": [{"fact": 0, "event": "ADD", "id": ""}]}"""


def extraction_messages(messages: list[dict], now: datetime | None = None) -> list[dict]:
    """The extraction chat: the rules, then the conversation, each turn dated as stored turns are."""
    today = now_of(messages, now)
    conversation = "\n".join(turn_text(m) for m in messages if m["content"].strip())
    return [{"role": "system", "content": EXTRACT_SYSTEM.format(today=today)},
            {"role": "user", "content": f"Conversation:\n{conversation}\n\nFacts as JSON:"}]


def now_of(messages: list[dict], now: datetime | None = None) -> str:
    """The conversation's "today": its last message's timestamp, else now (UTC) - the date the
    model counts relative dates from when a message carries none."""
    stamp = next((m["timestamp"] for m in reversed(messages) if m.get("timestamp")), None)
    if stamp:
        return dated("", stamp).strip(" []")
    return dated("", (now or datetime.now(timezone.utc)).date().isoformat()).strip(" []")


def reconcile_messages(facts: list[str], memories: list[tuple[str, str]]) -> list[dict]:
    """The reconciliation chat; `memories`: (alias, text) of the stored candidates."""
    stored = json.dumps([{"id": alias, "text": text} for alias, text in memories], ensure_ascii=False)
    new = json.dumps([{"fact": i, "text": text} for i, text in enumerate(facts)], ensure_ascii=False)
    return [{"role": "system", "content": RECONCILE_SYSTEM},
            {"role": "user", "content": f"Stored memories: {stored}\nNew facts: {new}\n\nDecisions as JSON:"}]


def facts_schema() -> dict:
    fact = {"type": "string", "minLength": 1, "maxLength": MAX_FACT_CHARS}
    return {"type": "object", "properties": {"facts": {"type": "array", "items": fact, "maxItems": MAX_FACTS}},
            "required": ["facts"], "additionalProperties": False}


def decisions_schema(n_facts: int, aliases: list[str]) -> dict:
    """One decision per fact at most; `id` limited to the aliases shown (or "" for none)."""
    decision = {"type": "object", "additionalProperties": False, "required": ["fact", "event", "id"],
                "properties": {"fact": {"type": "integer", "minimum": 0, "maximum": max(0, n_facts - 1)},
                               "event": {"type": "string", "enum": list(EVENTS)},
                               "id": {"type": "string", "enum": ["", *aliases]}}}
    return {"type": "object", "properties": {"decisions": {"type": "array", "items": decision,
                                                           "maxItems": n_facts}},
            "required": ["decisions"], "additionalProperties": False}


def max_tokens_for(schema: dict) -> int:
    """Room for the longest reply the schema allows (a token is at least one character, plus
    JSON punctuation), so a length cut never halves a valid reply; a model that closes its JSON
    early stops there (the grammar ends it), so the room costs nothing then."""
    props = schema["properties"]
    if "facts" in props:
        return MAX_FACTS * (MAX_FACT_CHARS + 8) + 32
    return props["decisions"]["maxItems"] * 48 + 32
