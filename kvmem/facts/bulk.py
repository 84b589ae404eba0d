"""Facts moved between homes (`kvmem export`, `kvmem import`) and counted (`kvmem stats`).

An export line holds one fact as it is: id, scope, text, metadata, origin, context, where it came
from, its times and its whole history; a deleted fact's line holds only its id, scope and history
(whose words were scrubbed when it was deleted). Neither KV blobs nor search vectors travel: both
are made again from the text (the importer embeds, the encoder re-encodes), and a blob only ever
serves the model it was made with.

Import writes each line verbatim (same id, times and history events) so that importing a file a
second time finds every id already known and stores nothing. Every line is checked here, by the
checks `add` uses, before any SQL runs: the CLI checks a whole file before storing any of it.
The functions taking a Connection run with the store's lock held; `Bulk` is FactStore's part that
calls them (mixed into it, as expiry.py's Expiry is, so store.py stays a screenful).
"""

from __future__ import annotations

import json
import math
import time
import builtins
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

from kvmem.errors import InvalidInputError
from kvmem.facts import sql
from kvmem.facts.checks import as_vector, is_int, new_row
from kvmem.facts.dialect import Connection
from kvmem.facts.records import COLUMNS, FIELDS, HISTORY_EVENTS, KV_STATUSES, SCHEMA_VERSION, vector_blob
from kvmem.facts.scope import Scope
from kvmem.facts.text import check_unicode
from kvmem.ids import check_fact_id

EXPORT_VERSION = 1
HEADER = "kvmem_export"  # the key that marks a header line; its value is the EXPORT_VERSION
SCOPE_KEYS = ("user_id", "agent_id", "run_id")
FACT_KEYS = ("id", *SCOPE_KEYS, "text", "metadata", "origin", "context", "source", "event_time", "position",
             "conversation_id", "created_at", "updated_at", "expires_at", "history")
DELETED_KEYS = ("id", *SCOPE_KEYS, "deleted", "history")
EVENT_KEYS = ("event", "old_text", "new_text", "at")
_IN_CHUNK = 500  # ids per IN (...) list: well under every database's parameter limit
_PAGE = 1000  # facts per lock hold when exporting, so a long export never starves writers
_INSERT = f"INSERT INTO facts ({COLUMNS}) VALUES ({', '.join(':' + f for f in FIELDS)})"
_LOG = ("INSERT INTO history (fact_id, event, old_text, new_text, at, scope_key, user_id, agent_id, run_id)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)")
_KNOWN = "SELECT id FROM facts WHERE id IN ({0}) UNION SELECT fact_id FROM history WHERE fact_id IN ({0})"
_GONE = "NOT EXISTS (SELECT 1 FROM facts WHERE facts.id = history.fact_id)"


@dataclass(frozen=True)
class Item:
    """One line to import: its fact's row (None for a deleted fact: its history alone) and events."""

    fact_id: str
    scope: Scope
    row: dict[str, Any] | None
    events: tuple[dict[str, Any], ...]

    def embedded(self, vector: Any) -> Item:
        """The item with its search vector in its row."""
        vec = as_vector(vector)
        return replace(self, row={**self.row, "embedding": vector_blob(vec), "embedding_dim": vec.size})


def header(scope: Mapping[str, str | None] | None = None) -> dict[str, Any]:
    """An export's first line: format version, schema version, when, and what was asked for."""
    return {HEADER: EXPORT_VERSION, "schema": SCHEMA_VERSION, "exported_at": time.time(), "scope": scope}


# -- reading a line -------------------------------------------------------------------------------


def parse(obj: object, now: float) -> Item | None:
    """A decoded line as an Item, None for a header line; InvalidInputError names the field at
    fault. `now`: the times of a hand-written line that gives none."""
    if not isinstance(obj, dict):
        raise InvalidInputError(f"a line must be a JSON object, got {type(obj).__name__}", param="line")
    if HEADER in obj:
        if obj[HEADER] != EXPORT_VERSION:
            raise InvalidInputError(f"export format {obj[HEADER]!r} is not one this kvmem reads ({EXPORT_VERSION})",
                                    param=HEADER)
        return None
    deleted = obj.get("deleted", False)
    if not isinstance(deleted, bool):
        raise InvalidInputError(f"deleted must be true or false, got {deleted!r}", param="deleted")
    unknown = sorted(set(obj) - set(DELETED_KEYS if deleted else (*FACT_KEYS, "deleted")))
    if unknown:
        why = " (a deleted fact's line holds only id, scope and history)" if deleted else ""
        raise InvalidInputError(f"unknown keys {unknown}{why}", param=unknown[0])
    scope = Scope(*(obj.get(key) for key in SCOPE_KEYS))
    if deleted:
        return Item(check_fact_id(obj.get("id")), scope, None, _history(obj.get("history"), deleted=True))
    return _live(obj, scope, now)


def _live(obj: dict[str, Any], scope: Scope, now: float) -> Item:
    for name in ("context", "origin"):
        if isinstance(obj.get(name), str):
            check_unicode(name, obj[name])
    row = new_row(scope, obj.get("text"), metadata=obj.get("metadata"), source=obj.get("source", "fact"),
                  context=obj.get("context", ""), event_time=obj.get("event_time"), position=obj.get("position"),
                  conversation_id=obj.get("conversation_id"), fact_id=obj.get("id"), origin=obj.get("origin", ""),
                  expires_at=obj.get("expires_at"))
    row["created_at"] = _time(obj.get("created_at", now), "created_at")
    row["updated_at"] = _time(obj.get("updated_at", row["created_at"]), "updated_at")
    if "history" not in obj:  # a hand-written line: it was added when it says
        events = ({"event": "ADD", "old_text": None, "new_text": row["text"], "at": row["created_at"]},)
    else:
        events = _history(obj["history"], deleted=False)
    return Item(row["id"], scope, row, events)


def _history(raw: object, *, deleted: bool) -> tuple[dict[str, Any], ...]:
    if not isinstance(raw, list) or (deleted and not raw):
        raise InvalidInputError("history must be a list of events" + (", ending with DELETE" if deleted else ""),
                                param="history")
    events = tuple(_event(e, f"history[{i}]") for i, e in enumerate(raw))
    if deleted:
        # Forgetting is real: an import must not bring back the words a delete scrubbed.
        if any(e["old_text"] is not None or e["new_text"] is not None for e in events):
            raise InvalidInputError("a deleted fact's history holds no text (scrubbed when it was deleted)",
                                    param="history")
        if events[-1]["event"] != "DELETE":
            raise InvalidInputError("a deleted fact's history ends with its DELETE event", param="history")
    elif any(e["event"] == "DELETE" for e in events):
        raise InvalidInputError('a stored fact\'s history has no DELETE event (a deleted fact\'s line says '
                                '"deleted": true)', param="history")
    return events


def _event(raw: object, where: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise InvalidInputError(f"{where} must be an object with keys {list(EVENT_KEYS)}", param=where)
    unknown = sorted(set(raw) - set(EVENT_KEYS))
    if unknown:
        raise InvalidInputError(f"{where} has unknown keys {unknown}", param=where)
    if raw.get("event") not in HISTORY_EVENTS:
        raise InvalidInputError(f"{where}.event must be one of {HISTORY_EVENTS}, got {raw.get('event')!r}",
                                param=where)
    for key in ("old_text", "new_text"):
        value = raw.get(key)
        if value is not None and not isinstance(value, str):
            raise InvalidInputError(f"{where}.{key} must be a string or null", param=where)
        if value is not None:
            check_unicode(f"{where}.{key}", value, param=where)
    return {"event": raw["event"], "old_text": raw.get("old_text"), "new_text": raw.get("new_text"),
            "at": _time(raw.get("at"), f"{where}.at")}


def _time(value: object, name: str) -> float:
    """Seconds since the epoch, as the store keeps them."""
    if not (is_int(value) or isinstance(value, float)) or not math.isfinite(value):
        raise InvalidInputError(f"{name} must be a number of seconds since the epoch, got {value!r}", param=name)
    return float(value)


# -- writing (under the store's write transaction) -------------------------------------------------


def insert(conn: Connection, item: Item) -> str:
    """Store the item as it is: "created", or "present" (its id is known here, stored or deleted:
    imported before) or "duplicate" (a fact of its scope has its text), each storing nothing."""
    if known(conn, [item.fact_id]):
        return "present"
    if item.row is not None:
        clash = conn.execute("SELECT 1 FROM facts WHERE scope_key = ? AND content_hash = ?",
                             (item.row["scope_key"], item.row["content_hash"])).fetchone()
        if clash is not None:
            return "duplicate"
        conn.execute(_INSERT, item.row)
    s = item.scope
    conn.executemany(_LOG, [(item.fact_id, e["event"], e["old_text"], e["new_text"], e["at"], s.key, s.user_id,
                             s.agent_id, s.run_id) for e in item.events])
    return "created"


def duplicates(conn: Connection, items: list[Item]) -> set[str]:
    """The ids of those items whose text their scope already holds (under any id)."""
    query = "SELECT 1 FROM facts WHERE scope_key = ? AND content_hash = ?"
    return {item.fact_id for item in items if item.row is not None
            and conn.execute(query, (item.row["scope_key"], item.row["content_hash"])).fetchone() is not None}


def known(conn: Connection, ids: list[str]) -> set[str]:
    """Those of `ids` that name a fact here, stored or deleted (its history stays)."""
    found: set[str] = set()
    for start in range(0, len(ids), _IN_CHUNK):
        chunk = ids[start:start + _IN_CHUNK]
        marks = ", ".join("?" * len(chunk))
        found.update(row[0] for row in conn.execute(_KNOWN.format(marks), (*chunk, *chunk)).fetchall())
    return found


# -- reading for an export (under the store's lock, a page at a time) -------------------------------


def live_page(conn: Connection, clause: str, params: list[str], after: tuple[float, int] | None,
              limit: int) -> tuple[list[dict[str, Any]], tuple[float, int] | None]:
    """Up to `limit` stored facts after `after` (created_at, rowid) as export lines, and the next
    `after`; keyset paging, so the lock is not held between pages."""
    joiner = " AND " if clause else " WHERE "
    query = (f"SELECT rowid, {COLUMNS} FROM facts{clause}{joiner}(created_at, rowid) > (?, ?)"
             " ORDER BY created_at, rowid LIMIT ?")
    rows = conn.execute(query, (*params, *(after or (float("-inf"), 0)), limit)).fetchall()
    events = _events_of(conn, [row["id"] for row in rows])
    page = [_fact_line(row, events.get(row["id"], [])) for row in rows]
    return page, ((rows[-1]["created_at"], rows[-1]["rowid"]) if rows else after)


def deleted_ids(conn: Connection, clause: str, params: list[str]) -> list[tuple[str, Scope]]:
    """The deleted facts of the scope (those with history but no row), in the order they were added."""
    joiner = " AND " if clause else " WHERE "
    query = (f"SELECT fact_id, user_id, agent_id, run_id, MIN(id) AS first_event FROM history{clause}{joiner}"
             f"{_GONE} GROUP BY fact_id, user_id, agent_id, run_id ORDER BY first_event")
    return [(row["fact_id"], Scope(row["user_id"], row["agent_id"], row["run_id"]))
            for row in conn.execute(query, params).fetchall()]


def deleted_page(conn: Connection, facts: list[tuple[str, Scope]]) -> list[dict[str, Any]]:
    """These deleted facts' export lines."""
    events = _events_of(conn, [fact_id for fact_id, _ in facts])
    return [{"id": fact_id, **_scope_fields(scope), "deleted": True, "history": events.get(fact_id, [])}
            for fact_id, scope in facts]


def _events_of(conn: Connection, ids: list[str]) -> dict[str, list[dict[str, Any]]]:
    """fact id -> its history events, oldest first."""
    out: dict[str, list[dict[str, Any]]] = {}
    for start in range(0, len(ids), _IN_CHUNK):
        chunk = ids[start:start + _IN_CHUNK]
        query = (f"SELECT fact_id, event, old_text, new_text, at FROM history WHERE fact_id IN "
                 f"({', '.join('?' * len(chunk))}) ORDER BY id")
        for row in conn.execute(query, chunk).fetchall():
            out.setdefault(row["fact_id"], []).append({key: row[key] for key in EVENT_KEYS})
    return out


def _fact_line(row: Mapping[str, Any], events: list[dict[str, Any]]) -> dict[str, Any]:
    line = {key: row[key] for key in FACT_KEYS[:-1]}
    line["metadata"] = json.loads(row["metadata"])
    return {**line, "history": events}


def _scope_fields(scope: Scope) -> dict[str, str | None]:
    return {"user_id": scope.user_id, "agent_id": scope.agent_id, "run_id": scope.run_id}


# -- counting ---------------------------------------------------------------------------------------


def tally(conn: Connection, clause: str, params: list[str], top: int) -> dict[str, Any]:
    """What `kvmem stats` shows of the store: facts by KV status, users, scopes, facts without a
    search vector, history events, deleted facts, and the `top` users with the most facts."""
    joiner = " AND " if clause else " WHERE "

    def one(query: str) -> int:
        return conn.execute(query, params).fetchone()[0]

    by_status = dict.fromkeys(KV_STATUSES, 0)
    by_status.update({row[0]: row[1] for row in conn.execute(
        f"SELECT kv_status, COUNT(*) FROM facts{clause} GROUP BY kv_status", params).fetchall()})
    users = conn.execute(f"SELECT user_id, COUNT(*) AS n FROM facts{clause} GROUP BY user_id"
                         " ORDER BY n DESC, user_id LIMIT ?", (*params, top)).fetchall()
    return {
        "facts": sum(by_status.values()),
        "kv_status": by_status,
        "users": one(f"SELECT COUNT(DISTINCT user_id) FROM facts{clause}"),
        "scopes": one(f"SELECT COUNT(DISTINCT scope_key) FROM facts{clause}"),
        "without_vector": one(f"SELECT COUNT(*) FROM facts{clause}{joiner}embedding IS NULL"),
        "history_events": one(f"SELECT COUNT(*) FROM history{clause}"),
        "deleted_facts": one(f"SELECT COUNT(DISTINCT fact_id) FROM history{clause}{joiner}{_GONE}"),
        "top_users": {row[0]: row[1] for row in users},
    }


class Bulk:
    """FactStore's whole-scope methods (mixed into it): export, import, and counts."""

    def export(self, *, user_id: str | None = None, agent_id: str | None = None,
               run_id: str | None = None) -> Iterator[dict[str, Any]]:
        """The scope's (or every) fact as an export line, oldest first, with its history; then the
        deleted facts' histories. Read a page at a time: a home written meanwhile gives a moving
        snapshot, but never one fact twice (the deleted ones are listed before the pages are read)."""
        clause, params = sql.filters(user_id, agent_id, run_id)
        with self._lock:
            deleted = deleted_ids(self._open(), clause, params)
        after = None
        while True:
            with self._lock:
                page, after = live_page(self._open(), clause, params, after, _PAGE)
            yield from page
            if len(page) < _PAGE:
                break
        for start in range(0, len(deleted), _PAGE):
            with self._lock:
                page = deleted_page(self._open(), deleted[start:start + _PAGE])
            yield from page

    def import_facts(self, items: Iterable[Item]) -> builtins.list[str]:
        """Store parsed export lines as they were (ids, times, history events), in one transaction;
        -> for each, insert's outcome. Facts come in pending: their KV is made anew here."""
        items = builtins.list(items)
        with self._tx() as conn:
            outcomes = [insert(conn, item) for item in items]
            for item, outcome in zip(items, outcomes):
                if outcome == "created" and item.row is not None:
                    self._dialect.changed(conn, "add", item.row)
        return outcomes

    def known_ids(self, ids: Iterable[str]) -> set[str]:
        """Those of `ids` that name a fact here, stored or deleted."""
        with self._lock:
            return known(self._open(), builtins.list(ids))

    def duplicate_ids(self, items: Iterable[Item]) -> set[str]:
        """The ids of those items whose text their scope already holds: import would skip them."""
        with self._lock:
            return duplicates(self._open(), builtins.list(items))

    def tally(self, *, user_id: str | None = None, top: int = 20) -> dict[str, Any]:
        """Counts for `kvmem stats` (see `tally` above), of one user's facts or everyone's."""
        clause, params = sql.filters(user_id, None, None)
        with self._lock:
            return tally(self._open(), clause, params, top)

    def scope_ids(self, user_prefix: str = "") -> builtins.list[tuple[str, Scope]]:
        """Every live fact's id and scope whose user id starts with `user_prefix` (a tenant's), in
        one query: what the inspector page counts its scopes from."""
        now = time.time()
        with self._lock:
            rows = self._open().execute(
                "SELECT id, user_id, agent_id, run_id FROM facts WHERE substr(user_id, 1, ?) = ?"
                " AND (expires_at IS NULL OR expires_at > ?) ORDER BY user_id, agent_id, run_id",
                (len(user_prefix), user_prefix, now)).fetchall()
        return [(row[0], Scope(row[1], row[2], row[3])) for row in rows]
