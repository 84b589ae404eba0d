"""What the fact stores hand out, FactRecord and HistoryEvent, and the limits both databases share.

Nothing here talks to a database: a row read by either dialect becomes a record here, and the
schema (schema.py) is written from the same field list, so a column cannot be added to one
without the other.
"""

from __future__ import annotations

import hashlib
import json
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from kvmem.facts.scope import Scope

KV_STATUSES = ("pending", "encoded", "failed", "evicted")
SOURCES = ("fact", "messages")
HISTORY_EVENTS = ("ADD", "UPDATE", "DELETE")
MAX_LIMIT = 10_000
MAX_OFFSET = (1 << 63) - 1  # SQLite's largest integer: OFFSET overflows beyond it
SCHEMA_VERSION = 5  # 2: kv_status 'evicted', table kv_usage; 3: column origin; 4: column expires_at;
# 5: history.source


@dataclass(frozen=True, eq=False)
class FactRecord:
    id: str
    scope_key: str
    user_id: str
    agent_id: str | None
    run_id: str | None
    text: str
    metadata: dict[str, Any]
    created_at: float
    updated_at: float
    source: str  # "fact" or "messages"
    event_time: str | None  # ISO timestamp of the message the fact came from
    context: str  # conversation window that preceded the fact
    position: int | None  # turn index within its conversation
    conversation_id: str | None
    content_hash: str
    kv_status: str  # "pending" | "encoded" | "failed" | "evicted" (blob dropped by the disk budget)
    kv_attempts: int
    embedding: np.ndarray | None  # float32, read-only
    embedding_dim: int | None
    origin: str  # the message a fact was drawn from: searched with it, never encoded
    expires_at: float | None  # Mem0's expiration_date: from then on never served, and swept

    @property
    def scope(self) -> Scope:
        return Scope(self.user_id, self.agent_id, self.run_id)

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and self.expires_at <= now

    def __eq__(self, other: object) -> bool:
        # Written by hand because == on numpy arrays is elementwise, not a bool.
        if not isinstance(other, FactRecord):
            return NotImplemented
        return all(_same(getattr(self, f), getattr(other, f)) for f in FIELDS)


@dataclass(frozen=True)
class HistoryEvent:
    fact_id: str
    event: str  # "ADD" | "UPDATE" | "DELETE"
    old_text: str | None  # None after the fact is deleted
    new_text: str | None
    at: float
    user_id: str | None = None  # whose fact it was: lets callers check ownership after a delete
    source: str | None = None  # what decided it: "infer" (an LLM's reconciliation), "expiry"; None: a caller


FIELDS = tuple(f.name for f in fields(FactRecord))  # the facts table's columns, in this order
COLUMNS = ", ".join(FIELDS)


def content_hash(text: str) -> str:
    """sha256 of the text with Unicode and whitespace differences normalized away."""
    normalized = unicodedata.normalize("NFC", " ".join(text.split()))
    return hashlib.sha256(normalized.encode("utf-8")).hexdigest()


def record(row: Mapping[str, Any]) -> FactRecord:
    """A facts row (sqlite3.Row, or pg.py's dict-like row) as the record callers get."""
    data = {name: row[name] for name in FIELDS}
    data["metadata"] = json.loads(data["metadata"])
    data["embedding"] = vector_from(data["embedding"])
    return FactRecord(**data)


def vector_blob(vec: np.ndarray) -> bytes:
    return vec.astype("<f4").tobytes()  # fixed byte order: the file may move between machines


def vector_from(blob: bytes | None) -> np.ndarray | None:
    if blob is None:
        return None
    vec = np.frombuffer(blob, dtype="<f4").astype(np.float32)
    vec.flags.writeable = False
    return vec


def _same(a: object, b: object) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and np.array_equal(a, b)
    return a == b
