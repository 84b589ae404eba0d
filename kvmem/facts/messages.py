"""Turning a conversation into turn facts, each with the window of turns that preceded it.

Context-Window Encoding: a turn's KV is computed after the `window` turns before it, so that
"She named it Bruno" is encoded knowing that "she" is the user's sister and "it" her puppy.
Only the turn's own KV is kept; the window just shapes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from kvmem.errors import InvalidInputError
from kvmem.facts.text import check_unicode

ROLES = ("user", "assistant", "system")
_PARAM = "messages"  # the field an error about a conversation names, whichever message is at fault


@dataclass(frozen=True)
class TurnFact:
    text: str  # "[timestamp] speaker: content" as stored, searched and injected
    context: str  # the preceding turns, rendered the way facts appear in prompts
    position: int  # turn index within the conversation
    role: str
    timestamp: str | None


def turn_text(message: dict) -> str:
    speaker = message.get("name") or message["role"]
    return dated(f"{speaker}: {message['content'].strip()}", message.get("timestamp"))


def dated(text: str, timestamp: str | None) -> str:
    """The text as stored, searched and read: "[9 May 2023] text" when it has a timestamp."""
    return f"[{shown_time(timestamp)}] {text}" if timestamp else text


def shown_time(timestamp: str) -> str:
    """A timestamp as the reader sees it. ISO 8601 becomes words ("2023-05-09" -> "9 May 2023",
    "2023-05-09T18:00:00" -> "9 May 2023, 18:00"): answers to "when" questions are dates in
    words, and a small model copies what it reads. Anything else ("1:56 pm on 8 May, 2023") is
    shown as given."""
    try:
        moment = datetime.fromisoformat(timestamp)
    except ValueError:
        return timestamp
    day = f"{moment.day} {moment:%B %Y}"
    return f"{day}, {moment:%H:%M}" if len(timestamp) > 10 else day  # a time of day was given


def turn_facts(messages: list[dict], window: int, fact_template: str) -> list[TurnFact]:
    check_messages(messages)
    if not isinstance(window, int) or window < 0:
        raise InvalidInputError(f"window must be an integer >= 0, got {window!r}", param="window")
    texts = [turn_text(m) for m in messages]
    facts = []
    for i, m in enumerate(messages):
        if not m["content"].strip():
            continue  # an empty turn carries no fact (it still counts as context position)
        context = "".join(fact_template.format(text=t) for t in texts[max(0, i - window) : i])
        facts.append(TurnFact(texts[i], context, i, m["role"], m.get("timestamp")))
    return facts


def check_messages(messages) -> None:
    """A conversation as kvmem takes it; errors name param "messages" (the HTTP field), or
    "timestamp" for a message's timestamp."""
    if not isinstance(messages, list) or not messages:
        raise InvalidInputError("messages must be a non-empty list of {'role', 'content'} dicts", param=_PARAM)
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidInputError(f"message {i} must be a dict, got {type(m).__name__}", param=_PARAM)
        if m.get("role") not in ROLES:
            raise InvalidInputError(f"message {i}: role must be one of {ROLES}, got {m.get('role')!r}", param=_PARAM)
        if not isinstance(m.get("content"), str):
            raise InvalidInputError(f"message {i}: content must be a string, got {type(m.get('content')).__name__}",
                                    param=_PARAM)
        check_unicode(f"message {i} content", m["content"], param=_PARAM)
        for field in ("name", "timestamp"):
            value = m.get(field)
            param = "timestamp" if field == "timestamp" else _PARAM  # what the HTTP API has always named
            if value is not None and not isinstance(value, str):
                raise InvalidInputError(f"message {i}: {field} must be a string, got {type(value).__name__}",
                                        param=param)
            if value is not None:
                check_unicode(f"message {i} {field}", value, param=param)
