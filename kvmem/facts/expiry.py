"""Memory expiry, Mem0's `expiration_date`: when a fact stops being served, and the sweep.

A fact's `expires_at` (seconds since the epoch; NULL: never) is set on add or update. From that
instant searches, listings and chats skip it (kvmem.retrieval), and the next sweep forgets it
as a delete does: text, vector, KV blob, history words. Mem0 takes a day ("2025-12-31"): the
fact holds through that day, UTC, and expires when the next one begins; a datetime expires at
that instant. A date already past is accepted: the fact is stored, never served, and swept.

`Expiry` is FactStore's part that writes expiry, kept here so store.py stays a screenful; it
uses the store's connection, lock and transactions as the rest of the class does.
"""

from __future__ import annotations

import builtins
from datetime import date, datetime, time, timezone
from typing import Any

from kvmem.errors import InvalidInputError
from kvmem.facts import sql
from kvmem.facts.checks import LATEST_EXPIRY, check_expires_at
from kvmem.facts.records import COLUMNS, FactRecord, record


class _Keep:
    def __repr__(self) -> str:
        return "KEEP"


_DAY_S = 86_400.0  # added, not a day's timedelta: the day after 9999-12-31 is past datetime's range
KEEP: Any = _Keep()  # update's default: the fact keeps the expiry it has (None would clear it)


def expires_at_of(value: object) -> float | None:
    """Mem0's expiration_date (None, an ISO day or datetime string, a date or a datetime) as the
    instant the fact expires, in seconds since the epoch; InvalidInputError otherwise."""
    if value is None:
        return None
    if isinstance(value, str):
        value = _parsed(value.strip())
    if isinstance(value, datetime):
        return check_expires_at((value if value.tzinfo else value.replace(tzinfo=timezone.utc)).timestamp())
    if isinstance(value, date):  # the whole day holds; it expires when the next one begins (UTC)
        # 9999-12-31 (a common "never") holds to datetime's last instant: the next day is past its range.
        return min(datetime.combine(value, time(), timezone.utc).timestamp() + _DAY_S, LATEST_EXPIRY)
    raise InvalidInputError(f"expiration_date must be an ISO date (YYYY-MM-DD), a datetime or None, got {value!r}",
                            param="expiration_date")


def _parsed(text: str) -> date | datetime | str:
    for kind in (date, datetime):  # a bare day first: datetime would read it as that day's midnight
        try:
            return kind.fromisoformat(text)
        except ValueError:
            continue
    return text  # refused by the caller, which quotes it


class Expiry:
    """The expiry writes of FactStore (mixed into it)."""

    def set_expiry(self, fact_id: str, expires_at: float | None) -> FactRecord:
        """The fact's new expiry (None: never); no history event, the text is unchanged."""
        expires_at = check_expires_at(expires_at)
        with self._tx() as conn:
            row = sql.fetch(conn, fact_id)
            if row["expires_at"] != expires_at:
                sql.set_columns(conn, fact_id, {"expires_at": expires_at})
                self._dialect.changed(conn, "update", row)
            return record(sql.fetch(conn, fact_id))

    def delete_expired(self, now: float) -> builtins.list[FactRecord]:
        """Forget every fact expired by `now`, as delete does; -> them, as they were. Cheap when
        none is: one read of the expiry index, no write transaction."""
        query = f"SELECT {COLUMNS} FROM facts WHERE expires_at <= ? ORDER BY expires_at"
        with self._lock:
            if not self._open().execute(query + " LIMIT 1", (now,)).fetchall():
                return []
        with self._tx() as conn:
            rows = conn.execute(query, (now,)).fetchall()
            sql.forget(conn, rows, "expiry")
            for row in rows:
                self._dialect.changed(conn, "delete", row)
        if rows:
            self._forgotten()
        return [record(row) for row in rows]
