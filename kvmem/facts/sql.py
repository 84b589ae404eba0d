"""The statements FactStore runs inside its transactions, the same on SQLite and PostgreSQL.

Each takes the open Connection and is called with the store's lock held (and, for writes, inside
the write transaction the dialect began), so a read made here stays true until the commit.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

from kvmem.errors import InvalidInputError, UnknownFactError
from kvmem.facts.checks import lookup_id
from kvmem.facts.dialect import Connection
from kvmem.facts.records import COLUMNS, FIELDS, FactRecord, record
from kvmem.facts.scope import check_scope_field

_INSERT = f"INSERT INTO facts ({COLUMNS}) VALUES ({', '.join(':' + f for f in FIELDS)})"
_ID_USED = "SELECT 1 FROM facts WHERE id = ? UNION ALL SELECT 1 FROM history WHERE fact_id = ? LIMIT 1"
_LOG = ("INSERT INTO history (fact_id, event, old_text, new_text, at, scope_key, user_id, agent_id, run_id,"
        " source) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)")


def fetch(conn: Connection, fact_id: str) -> Mapping[str, Any]:
    """The fact's row, or UnknownFactError."""
    row = conn.execute(f"SELECT {COLUMNS} FROM facts WHERE id = ?", (lookup_id(fact_id),)).fetchone()
    if row is None:
        raise UnknownFactError(fact_id)
    return row


def still(row: Mapping[str, Any], if_text: str | None) -> bool:
    return if_text is None or row["text"] == if_text


def insert(conn: Connection, row: dict[str, Any], source: str | None = None) -> tuple[FactRecord, bool]:
    """(record, created): the new fact, or the one in its scope that already has this text.
    `source`: what decided the write, for its history event (HistoryEvent.source)."""
    sql = f"SELECT {COLUMNS} FROM facts WHERE scope_key = ? AND content_hash = ?"
    existing = conn.execute(sql, (row["scope_key"], row["content_hash"])).fetchone()
    if existing is not None:
        return record(existing), False
    # An id seen in history too: reusing a deleted fact's id would splice two facts' histories.
    if conn.execute(_ID_USED, (row["id"], row["id"])).fetchone():
        raise InvalidInputError(f"fact id {row['id']!r} is already in use", param="fact_id")
    row["created_at"] = row["updated_at"] = time.time()
    conn.execute(_INSERT, row)
    log(conn, "ADD", row, None, row["text"], row["created_at"], source)
    return record(row), True


def set_columns(conn: Connection, fact_id: str, changes: dict[str, Any]) -> None:
    assignments = ", ".join(f"{name} = :{name}" for name in changes)  # names are ours, never the caller's
    conn.execute(f"UPDATE facts SET {assignments} WHERE id = :_id", {**changes, "_id": fact_id})


def refuse_duplicate(conn: Connection, old: Mapping[str, Any], digest: str) -> None:
    """InvalidInputError if another fact of the scope already has the text hashed to `digest`."""
    sql = "SELECT id FROM facts WHERE scope_key = ? AND content_hash = ? AND id <> ?"
    clash = conn.execute(sql, (old["scope_key"], digest, old["id"])).fetchone()
    if clash is not None:
        # "facts": what the HTTP API has always named for a text that cannot be stored.
        raise InvalidInputError(f"fact text duplicates fact {clash['id']!r} in the same scope", param="facts")


def forget(conn: Connection, rows: Iterable[Mapping[str, Any]], source: str | None = None) -> None:
    """Delete these facts and scrub their words from history; the events themselves stay."""
    now = time.time()
    for row in rows:
        # Earlier events keep what happened and when, but lose the words.
        conn.execute("UPDATE history SET old_text = NULL, new_text = NULL WHERE fact_id = ?", (row["id"],))
        log(conn, "DELETE", row, None, None, now, source)
        conn.execute("DELETE FROM facts WHERE id = ?", (row["id"],))
        conn.execute("DELETE FROM kv_usage WHERE fact_id = ?", (row["id"],))


def log(conn: Connection, event: str, fact: Mapping[str, Any], old: str | None, new: str | None, at: float,
        source: str | None = None) -> None:
    conn.execute(_LOG, (fact["id"], event, old, new, at, fact["scope_key"], fact["user_id"], fact["agent_id"],
                        fact["run_id"], source))


def filters(
    user_id: str | None, agent_id: str | None, run_id: str | None, *, user_required: bool = False,
    live_at: float | None = None,
) -> tuple[str, list[Any]]:
    """(" WHERE ..." or "", its parameters) for a listing narrowed to the given scope fields, and
    with `live_at` to the facts not expired by then."""
    given = {
        "user_id": check_scope_field("user_id", user_id, required=user_required),
        "agent_id": check_scope_field("agent_id", agent_id, required=False),
        "run_id": check_scope_field("run_id", run_id, required=False),
    }
    used: dict[str, Any] = {name: value for name, value in given.items() if value is not None}
    terms = [f"{name} = ?" for name in used]
    if live_at is not None:
        terms.append("(expires_at IS NULL OR expires_at > ?)")
        used["live_at"] = live_at
    clause = " AND ".join(terms)
    return (f" WHERE {clause}" if clause else ""), list(used.values())


def pending_where(max_attempts: int | None) -> tuple[str, tuple]:
    """The WHERE clause (and its parameters) of facts still waiting for their KV."""
    if max_attempts is None:
        return " WHERE kv_status IN ('pending', 'failed')", ()
    return " WHERE kv_status IN ('pending', 'failed') AND kv_attempts < ?", (max_attempts,)
