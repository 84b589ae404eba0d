"""Which strings kvmem accepts: valid Unicode everywhere, and facts that show something.

A JSON client can send a lone UTF-16 surrogate ("a\\ud800"); Python keeps it in a str, but
SQLite, the tokenizer and hashing all need UTF-8 and would fail deep inside. So every string
that enters the service is checked here first, and refused with a message naming its field.
"""

from __future__ import annotations

import unicodedata

from kvmem.errors import InvalidInputError

# Categories that render as nothing: controls, format characters (zero-width, BOM), surrogates,
# private use, unassigned, and separators (spaces, line and paragraph breaks).
_INVISIBLE = {"Cc", "Cf", "Cs", "Co", "Cn", "Zs", "Zl", "Zp"}


def check_unicode(name: str, value: str, *, param: str | None = None) -> str:
    """`value` if it encodes as UTF-8, else InvalidInputError naming `name` and the position.

    The error's `param` is `param`, or `name` itself when that is the field's name (callers whose
    `name` is a phrase, "message 2 content", pass the field: "messages")."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidInputError(f"{name} is not valid Unicode text: a lone surrogate "
                                f"{value[e.start]!a} at character {e.start}", param=param or name) from None
    return value


def check_nested(name: str, value: object, *, param: str | None = None) -> None:
    """check_unicode over every string in a JSON-like value: dict keys and values, list items.
    Errors name the field `param`, by default `name` (a bad key too: "metadata key ..." -> "metadata")."""
    param = param or name
    if isinstance(value, str):
        check_unicode(name, value, param=param)
    elif isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str):
                check_unicode(f"{name} key", key, param=param)
            check_nested(name, item, param=param)
    elif isinstance(value, (list, tuple)):
        for item in value:
            check_nested(name, item, param=param)


def visible(text: str) -> bool:
    """True when some character of `text` would be seen (not only controls, zero-widths, spaces)."""
    return any(unicodedata.category(c) not in _INVISIBLE for c in text)


def check_fact_text(text: object, name: str = "fact", *, param: str = "facts") -> str:
    """A fact's text: a string, valid Unicode, with at least one visible character.

    `param` is "facts" whatever the `name`: what the HTTP API has always named for a fact's text."""
    if not isinstance(text, str) or not text.strip():
        raise InvalidInputError(f"{name} must be a non-empty string", param=param)
    check_unicode(name, text, param=param)
    if not visible(text):
        raise InvalidInputError(f"{name} has no visible characters (only controls, zero-width or spaces)",
                                param=param)
    return text


def search_text(text: str, context: str, origin: str = "") -> str:
    """What a fact is found by: its text, then the context it is encoded after, then the message it
    was drawn from (its origin: searched, never encoded).

    A turn such as "Yes, we went there last summer!" names neither the place nor who went; the
    turns before it do. Embedding and indexing the turn with that window (the same one its KV is
    computed after) lifted LoCoMo evidence recall@10 from 0.757 to 0.808 on the tuning
    conversations (docs/benchmarks.md). A fact extracted from a message is found by that
    message's words too (observation memory 0.659 -> 0.695), while its KV stays encoded alone:
    encoding it after the message cost KV mode gold-answer log-likelihood. The text comes first
    so that an embedder's truncation cuts the context, never the fact."""
    return "\n".join(part for part in (text, context, origin) if part)
