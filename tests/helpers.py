"""Small helpers shared by the engine tests."""

from __future__ import annotations


def add_fact(mem, user_id: str, text: str, context: str = "", encode: str = "sync"):
    """Store one fact and return its record."""
    (fact_id,) = mem.add(facts=[text], user_id=user_id, context=context, encode=encode).ids
    return mem.get(fact_id)


def tokens(mem, record) -> tuple[int, ...]:
    return mem.prompts.fact_tokens(record.text)
