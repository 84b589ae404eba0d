"""The fact stores' tables, written once: each dialect only says how it spells a few types.

facts: one row per fact (records.FIELDS, in that order), plus a `rowid` that orders rows added in
the same instant: SQLite has one on every table; PostgreSQL gets an identity column of that name.
history: every ADD/UPDATE/DELETE of a fact, kept after the fact is deleted (texts scrubbed).
kv_usage: how many chats used each fact's KV, for the disk budget's eviction order.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmem.facts.records import HISTORY_EVENTS, KV_STATUSES, SOURCES


@dataclass(frozen=True)
class Types:
    """How one dialect spells what the schema needs."""

    time: str  # seconds since the epoch, 8-byte float (PostgreSQL's REAL is only 4 bytes)
    integer: str  # 64-bit (SQLite's INTEGER is; PostgreSQL's is 32-bit)
    bytes: str  # a vector's float32s
    rowid: str  # the facts table's own `rowid` column ("" where the database has one built in)
    history_key: str  # history.id: grows with each event, so it orders a fact's history
    order_tail: str  # appended to the ordering indexes: SQLite's entries end with the rowid already


SQLITE = Types(time="REAL", integer="INTEGER", bytes="BLOB", rowid="", history_key="INTEGER PRIMARY KEY",
               order_tail="")
POSTGRES = Types(time="DOUBLE PRECISION", integer="BIGINT", bytes="BYTEA",
                 rowid="rowid BIGINT GENERATED ALWAYS AS IDENTITY UNIQUE",
                 history_key="BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY", order_tail=", rowid")


def facts_table(t: Types, name: str = "facts") -> str:
    """CREATE TABLE for the facts (under another `name` when SQLite rebuilds the table)."""
    columns = [
        "id TEXT PRIMARY KEY",
        "scope_key TEXT NOT NULL",
        "user_id TEXT NOT NULL",
        "agent_id TEXT",
        "run_id TEXT",
        "text TEXT NOT NULL",
        "metadata TEXT NOT NULL",  # JSON
        f"created_at {t.time} NOT NULL",
        f"updated_at {t.time} NOT NULL",
        f"source TEXT NOT NULL CHECK (source IN ({_quoted(SOURCES)}))",
        "event_time TEXT",
        "context TEXT NOT NULL",
        f"position {t.integer}",
        "conversation_id TEXT",
        "content_hash TEXT NOT NULL",
        f"kv_status TEXT NOT NULL CHECK (kv_status IN ({_quoted(KV_STATUSES)}))",
        f"kv_attempts {t.integer} NOT NULL",
        f"embedding {t.bytes}",
        f"embedding_dim {t.integer}",
        "origin TEXT NOT NULL DEFAULT ''",
        f"expires_at {t.time}",  # NULL: never
    ]
    return _table(name, [t.rowid, *columns] if t.rowid else columns)


def statements(t: Types) -> tuple[str, ...]:
    """Every table and index, each created only where it is missing (safe on every start)."""
    tail = t.order_tail
    history = [
        f"id {t.history_key}",
        "fact_id TEXT NOT NULL",
        f"event TEXT NOT NULL CHECK (event IN ({_quoted(HISTORY_EVENTS)}))",
        "old_text TEXT",
        "new_text TEXT",
        f"at {t.time} NOT NULL",
        "scope_key TEXT NOT NULL",
        "user_id TEXT NOT NULL",
        "agent_id TEXT",
        "run_id TEXT",
        "source TEXT",  # NULL: a caller's own write (records.HistoryEvent.source)
    ]
    return (
        facts_table(t),
        # Dedupe per scope: `add` checks first, this is the backstop against a racing writer.
        "CREATE UNIQUE INDEX IF NOT EXISTS facts_scope_hash ON facts (scope_key, content_hash)",
        f"CREATE INDEX IF NOT EXISTS facts_order ON facts (created_at{tail})",
        f"CREATE INDEX IF NOT EXISTS facts_user_order ON facts (user_id, created_at{tail})",
        f"CREATE INDEX IF NOT EXISTS facts_kv ON facts (kv_status, kv_attempts, created_at{tail})",
        # The sweep looks for expired facts on every write: a range read, not a scan of the table.
        "CREATE INDEX IF NOT EXISTS facts_expiry ON facts (expires_at)",
        _table("history", history),
        "CREATE INDEX IF NOT EXISTS history_fact ON history (fact_id, id)",
        _table("kv_usage", ["fact_id TEXT PRIMARY KEY", f"hits {t.integer} NOT NULL"]),
    )


def _table(name: str, columns: list[str]) -> str:
    body = ",\n    ".join(columns)
    return f"CREATE TABLE IF NOT EXISTS {name} (\n    {body}\n)"


def _quoted(values: tuple[str, ...]) -> str:
    return ", ".join(f"'{v}'" for v in values)
