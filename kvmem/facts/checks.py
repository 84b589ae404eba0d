"""A caller's arguments -> a facts row, refused with InvalidInputError before any SQL runs.

Both dialects store exactly what these checks let through, so they refuse the same input with the
same message. Each error names its `param` (the argument, or the HTTP field it arrives in), so
the server never has to read the message to know which field was at fault.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

import numpy as np

from kvmem.errors import InvalidInputError, UnknownFactError
from kvmem.facts.records import MAX_LIMIT, MAX_OFFSET, SOURCES, content_hash, vector_blob
from kvmem.facts.scope import Scope, check_scope_field
from kvmem.facts.text import check_fact_text, check_nested
from kvmem.ids import check_fact_id

ADD_KEYS = frozenset({"scope", "text", "metadata", "source", "context", "event_time", "position", "conversation_id",
                      "embedding", "fact_id", "origin", "expires_at"})  # FactStore.add's keywords: add_many items


def new_row(
    scope: Scope,
    text: str,
    *,
    metadata: dict[str, Any] | None = None,
    source: str = "fact",
    context: str = "",
    event_time: str | datetime | None = None,
    position: int | None = None,
    conversation_id: str | None = None,
    embedding: Any = None,
    fact_id: str | None = None,
    origin: str = "",
    expires_at: float | None = None,
) -> dict[str, Any]:
    """The facts row `add` inserts (times are stamped later, inside the transaction)."""
    if not isinstance(scope, Scope):
        raise InvalidInputError(f"scope must be a Scope, got {type(scope).__name__}", param="scope")
    text = check_text(text)
    if source not in SOURCES:
        raise InvalidInputError(f"source must be one of {SOURCES}, got {source!r}", param="source")
    if not isinstance(context, str):
        raise InvalidInputError(f"context must be a string, got {type(context).__name__}", param="context")
    if not isinstance(origin, str):
        raise InvalidInputError(f"origin must be a string, got {type(origin).__name__}", param="origin")
    if position is not None and (not is_int(position) or position < 0):
        raise InvalidInputError(f"position must be None or an int >= 0, got {position!r}", param="position")
    vec = as_vector(embedding)
    return {
        "id": "f-" + uuid.uuid4().hex if fact_id is None else check_fact_id(fact_id),
        "scope_key": scope.key,
        "user_id": scope.user_id,
        "agent_id": scope.agent_id,
        "run_id": scope.run_id,
        "text": text,
        "metadata": metadata_json(metadata),
        "created_at": None,  # stamped inside the transaction, so time order follows commit order
        "updated_at": None,
        "source": source,
        "event_time": check_event_time(event_time),
        "context": context,
        "position": position,
        "conversation_id": check_scope_field("conversation_id", conversation_id, required=False),
        "content_hash": content_hash(text),
        "kv_status": "pending",
        "kv_attempts": 0,
        "embedding": None if vec is None else vector_blob(vec),
        "embedding_dim": None if vec is None else vec.size,
        "origin": origin,
        "expires_at": check_expires_at(expires_at),
    }


def check_item(item: object) -> dict[str, Any]:
    """One add_many item: a dict of add's argument names."""
    if not isinstance(item, Mapping):
        raise InvalidInputError(f"add_many items must be dicts, got {type(item).__name__}", param="items")
    unknown = set(item) - ADD_KEYS
    if unknown:
        raise InvalidInputError(f"add_many item has unknown keys {sorted(map(str, unknown))}", param="items")
    if "scope" not in item or "text" not in item:
        raise InvalidInputError("add_many items need 'scope' and 'text'", param="items")
    return dict(item)


def check_text(text: object) -> str:
    return check_fact_text(text, "fact text").strip()


def metadata_json(metadata: object) -> str:
    """Metadata as stored: JSON that reads back exactly as given."""
    if metadata is None:
        return "{}"
    problem = "metadata must be a JSON-serializable dict with str keys"
    if not isinstance(metadata, dict):
        raise InvalidInputError(f"{problem}, got {type(metadata).__name__}", param="metadata")
    check_nested("metadata", metadata)
    try:
        encoded = json.dumps(metadata, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise InvalidInputError(f"{problem}: {e}", param="metadata") from None
    # json.dumps quietly turns int keys into str and tuples into lists; refuse what would not read back as given.
    if json.loads(encoded) != metadata:
        raise InvalidInputError(f"{problem} (and lists, not tuples): it would not read back as given",
                                param="metadata")
    return encoded


def check_event_time(value: object) -> str | None:
    if value is None:
        return None
    if isinstance(value, datetime):
        return value.isoformat()
    try:
        datetime.fromisoformat(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise InvalidInputError(f"event_time must be None, a datetime or an ISO 8601 string, got {value!r}",
                                param="event_time") from None
    return value  # type: ignore[return-value]


# The instants a datetime can hold, UTC: every fact shown renders its expiry as one (an expiry in
# the year 0 or 10000 was stored, then every listing of its user was a 500).
EARLIEST_EXPIRY = datetime.min.replace(tzinfo=timezone.utc).timestamp()
LATEST_EXPIRY = datetime(9999, 12, 31, 23, 59, 59, tzinfo=timezone.utc).timestamp()  # whole: a float
# holds no microsecond this far from 1970, and datetime.max would round up into the year 10000


def check_expires_at(value: object) -> float | None:
    """An expiry as stored: None (never) or seconds since the epoch (expiry.expires_at_of makes them)."""
    if value is None:
        return None
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not EARLIEST_EXPIRY <= value <= LATEST_EXPIRY:  # NaN fails the comparison too
        raise InvalidInputError(f"expires_at must be None or seconds since the epoch within years 1 to 9999 (UTC), "
                                f"got {value!r}", param="expiration_date")
    return float(value)


def check_page(limit: object, offset: object) -> None:
    if not is_int(limit) or not 1 <= limit <= MAX_LIMIT:  # type: ignore[operator]
        raise InvalidInputError(f"limit must be an int in 1..{MAX_LIMIT}, got {limit!r}", param="limit")
    if not is_int(offset) or not 0 <= offset <= MAX_OFFSET:  # type: ignore[operator]
        raise InvalidInputError(f"offset must be an int in 0..{MAX_OFFSET}, got {offset!r}", param="offset")


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def lookup_id(fact_id: object) -> str:
    """A fact id to look up: anything that is not valid text cannot name a fact (UnknownFactError,
    not a driver's encoding error)."""
    if not isinstance(fact_id, str):
        raise UnknownFactError(fact_id)  # type: ignore[arg-type]
    try:
        fact_id.encode("utf-8")
    except UnicodeEncodeError:
        raise UnknownFactError(ascii(fact_id)) from None
    if "\x00" in fact_id:  # no fact id holds one (check_fact_id), and PostgreSQL text cannot
        raise UnknownFactError(fact_id)
    return fact_id


def as_vector(vec: Any) -> np.ndarray | None:
    """An embedding as float32, or None; refused unless it is a finite, non-empty 1-D array."""
    if vec is None:
        return None
    arr = np.asarray(vec)
    if arr.dtype.kind not in "iuf" or arr.ndim != 1 or arr.size == 0:
        raise InvalidInputError(f"embedding must be a non-empty 1-D array of numbers, got {arr.shape} {arr.dtype}",
                                param="embedding")
    arr = arr.astype(np.float32)
    if not np.isfinite(arr).all():
        raise InvalidInputError("embedding must hold finite float32 numbers", param="embedding")
    return arr
