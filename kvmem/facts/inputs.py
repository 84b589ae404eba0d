"""A caller's `add` arguments -> the facts to store: one item per fact, checked and dated.

Pure: nothing here stores, embeds or tokenizes. `check_text(text, context)` is handed in by the
caller (it knows the model's token limits) and returns the text as stored.
"""

from __future__ import annotations

from datetime import datetime
from typing import Callable

from kvmem.errors import InvalidInputError
from kvmem.facts.messages import check_messages, dated, turn_facts
from kvmem.facts.text import check_fact_text, check_unicode

CheckText = Callable[[str, str], str]


def fact_items(messages, facts, *, context, window: int, metadata, timestamp, origin: str, template: str,
               check_text: CheckText) -> list[dict]:
    """Facts (`facts=[...]` or a str) or a conversation (a list of messages, one fact per turn)
    as the fact store's items: text, context, origin, source, position, event_time, metadata."""
    if (messages is None) == (facts is None):
        raise InvalidInputError("pass either messages (a conversation or one fact string) or facts=[...]",
                                param="messages")
    if isinstance(messages, str):
        facts, messages = [messages], None
    if not isinstance(origin, str):
        raise InvalidInputError(f"origin must be a string, got {type(origin).__name__}", param="origin")
    check_unicode("origin", origin)
    if origin and facts is None:
        raise InvalidInputError("origin applies to facts; a conversation's turns are their own origin",
                                param="origin")
    stamp = timestamp_of(timestamp)
    if facts is not None:
        return _fact_items(facts, context, metadata, stamp, origin, check_text)
    if stamp is not None:
        raise InvalidInputError("timestamp applies to facts; give each message its own timestamp",
                                param="timestamp")
    check_messages(messages)
    return [{"text": check_text(t.text, t.context), "context": t.context, "source": "messages",
             "position": t.position, "event_time": iso_or_none(t.timestamp),
             "metadata": with_timestamp(metadata, t.timestamp)} for t in turn_facts(messages, window, template)]


def _fact_items(facts, context, metadata, stamp: str | None, origin: str, check_text: CheckText) -> list[dict]:
    if not isinstance(facts, list) or not facts:
        raise InvalidInputError("facts must be a non-empty list of strings", param="facts")
    return [{"text": check_text(dated(check_fact_text(t).strip(), stamp), context), "context": context or "",
             "origin": origin, "source": "fact", "event_time": iso_or_none(stamp),
             "metadata": with_timestamp(metadata, stamp)} for t in facts]


def check_context(context: object) -> str:
    if not isinstance(context, str):
        raise InvalidInputError(f"context must be a string, got {type(context).__name__}", param="context")
    return check_unicode("context", context)


def int_at_least(value: object, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def timestamp_of(value: object) -> str | None:
    """A caller's timestamp for facts: None, a datetime, or a non-empty string (ISO or free text)."""
    if value is None:
        return None
    if isinstance(value, datetime):
        return value.isoformat()
    if not isinstance(value, str) or not value.strip():
        raise InvalidInputError(f"timestamp must be a datetime or a non-empty string, got {value!r}",
                                param="timestamp")
    return check_unicode("timestamp", value.strip())


def with_timestamp(metadata: object, timestamp: str | None) -> object:
    """The caller's metadata with the timestamp added; metadata that is not a dict is passed on
    unchanged for the fact store to refuse with its own message."""
    if not timestamp or not (metadata is None or isinstance(metadata, dict)):
        return metadata
    return {**(metadata or {}), "timestamp": timestamp}


def iso_or_none(timestamp: str | None) -> str | None:
    """Message timestamps are free text ("1:56 pm on 8 May, 2023"); only ISO ones become event_time.
    The text itself stays in the fact and in its metadata."""
    try:
        return datetime.fromisoformat(timestamp).isoformat() if timestamp else None
    except ValueError:
        return None
