"""The durable fact store: facts, their history and their embeddings, on SQLite or PostgreSQL.

`FactStore(path)` keeps them in one SQLite file (sqlite.py); `PgFactStore(url)` (pg.py) in a
PostgreSQL database that several processes share. Both are this class: the API, its validation
and every query are written once here and in sql.py, and the differences (connection, schema
types, write lock, change feed, what a delete must flush) live in their Dialect (dialect.py).

Design, in the spirit of Mem0's storage:

* One connection per store, shared by all threads behind a lock: each database allows a single
  writer at a time anyway, and the lock keeps a connection from being used by two threads at
  once. Multi-statement writes run in one transaction that takes the writers' lock at BEGIN, so
  they apply whole or not at all, and the reads they start with (dedupe) stay true.
* Forgetting is real: a delete also scrubs the fact's text from every earlier history event
  (the events stay, so the audit trail still says what happened and when), and then the dialect
  pushes the words out of what still holds them (SQLite's WAL file; see pg.py for PostgreSQL).
* Vectors live with the facts, not in a separate index file: one durable place, written in the
  same transactions, so vectors, facts and history can never disagree after a crash. The
  in-memory vector index is rebuilt from `embeddings()` at start-up.
* De-duplication is per scope on a hash of the normalized text (Unicode NFC, runs of whitespace
  collapsed; case is kept), enforced by a unique index as well as by `add`.
"""

from __future__ import annotations

import builtins
import json
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from datetime import datetime
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np

from kvmem.errors import InvalidInputError, KvmemError, UnknownFactError
from kvmem.facts import sql
from kvmem.facts.bulk import Bulk
from kvmem.facts.changes import Changes
from kvmem.facts.checks import as_vector, check_item, check_page, check_text, lookup_id, metadata_json, new_row
from kvmem.facts.dialect import Connection, Dialect
from kvmem.facts.expiry import Expiry
from kvmem.facts.records import (
    COLUMNS,
    KV_STATUSES,
    MAX_LIMIT,
    MAX_OFFSET,
    SCHEMA_VERSION,
    SOURCES,
    FactRecord,
    HistoryEvent,
    content_hash,
    record,
    vector_blob,
    vector_from,
)
from kvmem.facts.scope import Scope
from kvmem.facts.sqlite import SqliteDialect

__all__ = ["FactRecord", "FactStore", "HistoryEvent", "KV_STATUSES", "MAX_LIMIT", "MAX_OFFSET", "SCHEMA_VERSION",
           "SOURCES", "content_hash"]

_CHUNK = 1000  # rows per lock hold when streaming, so long scans never starve writers


class FactStore(Expiry, Bulk, Changes):
    """The facts of every user, in the SQLite file at `path` (PgFactStore: in PostgreSQL)."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._attach(SqliteDialect(self.path))

    def _attach(self, dialect: Dialect) -> None:
        """Open the store on `dialect`'s database (each constructor's last step)."""
        self._dialect = dialect
        self._lock = threading.Lock()
        self._conn: Connection | None = dialect.connect()

    # -- writing ---------------------------------------------------------------------------

    def add(
        self,
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
    ) -> tuple[FactRecord, bool]:
        """(record, created). A duplicate of a fact in the same scope returns that fact, unchanged."""
        row = new_row(
            scope, text, metadata=metadata, source=source, context=context, event_time=event_time,
            position=position, conversation_id=conversation_id, embedding=embedding, fact_id=fact_id, origin=origin,
        )  # fmt: skip
        with self._tx() as conn:
            return self._added(conn, sql.insert(conn, row))

    def add_many(self, items: Iterable[Mapping[str, Any]]) -> list[tuple[FactRecord, bool]]:
        """`add` for each item (dicts of add's argument names), all in one transaction."""
        rows = [new_row(**check_item(item)) for item in items]
        with self._tx() as conn:
            return [self._added(conn, sql.insert(conn, row)) for row in rows]

    def update(
        self, fact_id: str, text: str, *, metadata: dict[str, Any] | None = None, embedding: Any = None
    ) -> FactRecord:
        """New text (and optionally new metadata, replacing the old, and embedding)."""
        text = check_text(text)
        meta = None if metadata is None else metadata_json(metadata)
        vec = as_vector(embedding)
        digest = content_hash(text)
        with self._tx() as conn:
            old = sql.fetch(conn, fact_id)
            sql.refuse_duplicate(conn, old, digest)
            changes: dict[str, Any] = {} if meta is None else {"metadata": meta}
            if text != old["text"]:
                # The KV blob and the embedding were made from the old words: both must be remade.
                changes.update(text=text, content_hash=digest, kv_status="pending", kv_attempts=0)
                changes.update(embedding=None, embedding_dim=None)
            if vec is not None:
                changes.update(embedding=vector_blob(vec), embedding_dim=vec.size)
            changes = {k: v for k, v in changes.items() if old[k] != v}
            if changes:
                now = changes["updated_at"] = time.time()
                sql.set_columns(conn, fact_id, changes)
                sql.log(conn, "UPDATE", old, old["text"], text, now)
                self._dialect.changed(conn, "update", old)
            return record(sql.fetch(conn, fact_id))

    def delete(self, fact_id: str) -> FactRecord:
        """Forget one fact; returns it as it was."""
        with self._tx() as conn:
            row = sql.fetch(conn, fact_id)
            sql.forget(conn, [row])
            self._dialect.changed(conn, "delete", row)
        self._forgotten()
        return record(row)

    def delete_scope(
        self, scope: Scope | str, *, agent_id: str | None = None, run_id: str | None = None,
        where: Callable[[dict[str, Any]], bool] | None = None,
    ) -> list[str]:
        """Forget every fact of a user, narrowed by agent_id/run_id where given; returns their ids.

        A Scope is read the same way: Scope("u") deletes all of u's facts, whatever their agent or run.
        `where(metadata)` narrows it further, tested inside the transaction (so on the rows it deletes).
        """
        if isinstance(scope, Scope):
            if agent_id is not None or run_id is not None:
                raise InvalidInputError("give agent_id/run_id inside the Scope or as arguments, not both",
                                        param="agent_id")
            user_id, agent_id, run_id = scope.user_id, scope.agent_id, scope.run_id
        else:
            user_id = scope
        clause, params = sql.filters(user_id, agent_id, run_id, user_required=True)
        with self._tx() as conn:
            rows = conn.execute(f"SELECT {COLUMNS} FROM facts{clause} ORDER BY created_at, rowid", params).fetchall()
            if where is not None:
                rows = [row for row in rows if where(json.loads(row["metadata"]))]
            sql.forget(conn, rows)
            for row in rows:
                self._dialect.changed(conn, "delete", row)
        if rows:
            self._forgotten()
        return [row["id"] for row in rows]

    def set_kv_status(self, fact_id: str, status: str, *, if_text: str | None = None) -> bool:
        """Record the KV encoder's outcome; 'failed' counts an attempt. 'pending' (a new reason to
        encode: the blob failed at serving time, or vanished) starts the count again: a fact
        re-queued with its attempts spent (all met a full KV disk, say) was left pending and
        never encoded (tests/faults/test_storage_faults.py).

        With `if_text`, nothing is written (and False returned) unless the fact still has that
        text, so an encoder that raced an update cannot mark the new text as encoded.
        """
        if status not in KV_STATUSES:
            raise InvalidInputError(f"kv status must be one of {KV_STATUSES}, got {status!r}", param="status")
        attempts = {"failed": "kv_attempts + 1", "pending": "0"}.get(status, "kv_attempts")
        with self._tx() as conn:
            if not sql.still(sql.fetch(conn, fact_id), if_text):
                return False
            conn.execute(f"UPDATE facts SET kv_status = ?, kv_attempts = {attempts} WHERE id = ?", (status, fact_id))
        return True

    def set_embedding(self, fact_id: str, vec: Any, *, if_text: str | None = None) -> bool:
        """Store (or, with None, clear) a fact's embedding; `if_text` guards as in set_kv_status."""
        arr = as_vector(vec)
        blob, dim = (None, None) if arr is None else (vector_blob(arr), arr.size)
        with self._tx() as conn:
            row = sql.fetch(conn, fact_id)
            if not sql.still(row, if_text):
                return False
            conn.execute("UPDATE facts SET embedding = ?, embedding_dim = ? WHERE id = ?", (blob, dim, fact_id))
            self._dialect.changed(conn, "update", row)
        return True

    def reset(self) -> None:
        """Drop every fact and all history."""
        with self._tx() as conn:
            conn.execute("DELETE FROM facts")
            conn.execute("DELETE FROM history")
            conn.execute("DELETE FROM kv_usage")
            self._dialect.changed(conn, "reset", None)
        self._forgotten()

    def usage(self) -> dict[str, int]:
        """fact id -> chats that used it, as last saved (the disk budget's eviction history)."""
        with self._lock:
            rows = self._open().execute("SELECT fact_id, hits FROM kv_usage").fetchall()
        return {row[0]: row[1] for row in rows}

    def save_usage(self, hits: Mapping[str, int]) -> None:
        """Record these counts (facts deleted meanwhile are skipped: their history is gone)."""
        if not hits:
            return
        with self._tx() as conn:
            conn.executemany("INSERT INTO kv_usage (fact_id, hits) SELECT ?, ? WHERE EXISTS "
                             "(SELECT 1 FROM facts WHERE id = ?) ON CONFLICT (fact_id) DO UPDATE SET hits = excluded.hits",
                             [(fact_id, n, fact_id) for fact_id, n in hits.items()])

    def close(self) -> None:
        """Stop the change feeds and close the connection; a second close does nothing."""
        self._dialect.stop_feeds()
        with self._lock:
            if self._conn is None:
                return
            self._dialect.close(self._conn)
            self._conn = None

    def subscribe(self, callback: Callable[[dict[str, Any]], None]) -> Callable[[], None]:
        """Call `callback` with each change committed to the store; returns a function that stops it.

        On PostgreSQL (shared by several processes) this is a real feed, from a background thread,
        in commit order, of every process's changes, this one's included: {"op": "add" | "update" |
        "delete", "id": fact_id, "user_id": ...}, {"op": "reset"}, or {"op": "resync"} when changes
        may have been missed (a lost connection, a user id too long to announce): reload then. A
        callback that raises is logged and the feed goes on; `close()` stops every feed.

        SQLite has no way to tell one process of another's commits, and kvmem serves a SQLite file
        from one process (a CLI may open it beside that one for a while; several gateways share
        PostgreSQL instead): on SQLite this does nothing and returns a no-op.
        """
        with self._lock:
            self._open()  # a closed store refuses, as every other call does
        return self._dialect.subscribe(callback)

    def __enter__(self) -> FactStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reading ---------------------------------------------------------------------------

    def get(self, fact_id: str) -> FactRecord:
        with self._lock:
            return record(sql.fetch(self._open(), fact_id))

    def list(
        self,
        *,
        user_id: str | None = None,
        agent_id: str | None = None,
        run_id: str | None = None,
        limit: int = 100,
        offset: int = 0,
        where: Callable[[dict[str, Any]], bool] | None = None,
        live_at: float | None = None,
    ) -> list[FactRecord]:
        """Facts oldest first; `where(metadata)` filters before offset/limit are applied, and
        `live_at` (a time) leaves out the facts expired by then."""
        check_page(limit, offset)
        clause, params = sql.filters(user_id, agent_id, run_id, live_at=live_at)
        if where is None:
            query = f"SELECT {COLUMNS} FROM facts{clause} ORDER BY created_at, rowid LIMIT ? OFFSET ?"
            with self._lock:
                rows = self._open().execute(query, (*params, limit, offset)).fetchall()
            return [record(row) for row in rows]
        matches = (fact for fact in self._scan(clause, params) if where(fact.metadata))
        return [*islice(matches, offset, offset + limit)]

    def history(self, fact_id: str) -> builtins.list[HistoryEvent]:
        """Every event of a fact, oldest first, also after it was deleted (texts scrubbed then)."""
        query = ("SELECT fact_id, event, old_text, new_text, at, user_id, source FROM history WHERE fact_id = ?"
                 " ORDER BY id")
        with self._lock:
            rows = self._open().execute(query, (lookup_id(fact_id),)).fetchall()
        if not rows:
            raise UnknownFactError(fact_id)
        return [HistoryEvent(**dict(row)) for row in rows]

    def pending(self, limit: int = 100, *, max_attempts: int | None = None) -> builtins.list[FactRecord]:
        """Facts whose KV is not encoded yet, least-tried first, then oldest first."""
        check_page(limit, 0)
        where, params = sql.pending_where(max_attempts)
        query = f"SELECT {COLUMNS} FROM facts{where} ORDER BY kv_attempts, created_at, rowid LIMIT ?"
        with self._lock:
            rows = self._open().execute(query, (*params, limit)).fetchall()
        return [record(row) for row in rows]

    def count_pending(self, *, max_attempts: int | None = None) -> int:
        """How many facts `pending` would return without a limit."""
        where, params = sql.pending_where(max_attempts)
        with self._lock:
            return self._open().execute(f"SELECT COUNT(*) FROM facts{where}", params).fetchone()[0]

    def embeddings(self) -> Iterator[tuple[str, str, np.ndarray, dict[str, Any]]]:
        """(fact_id, scope_key, vector, metadata) of every fact that has an embedding."""
        for row in self._columns("id, scope_key, embedding, metadata", "embedding IS NOT NULL"):
            yield row["id"], row["scope_key"], vector_from(row["embedding"]), json.loads(row["metadata"])

    def texts(self) -> Iterator[tuple[str, str, str, str, str, dict[str, Any]]]:
        """(fact_id, scope_key, text, context, origin, metadata) of every fact."""
        for row in self._columns("id, scope_key, text, context, origin, metadata", "TRUE"):
            yield (row["id"], row["scope_key"], row["text"], row["context"], row["origin"],
                   json.loads(row["metadata"]))

    def count(self, user_id: str | None = None, agent_id: str | None = None, run_id: str | None = None, *,
              where: Callable[[dict[str, Any]], bool] | None = None, live_at: float | None = None) -> int:
        """Facts of the scope (all without one); with `where(metadata)`, those it passes; with
        `live_at`, those not expired by then."""
        clause, params = sql.filters(user_id, agent_id, run_id, live_at=live_at)
        if where is not None:
            return sum(1 for fact in self._scan(clause, params) if where(fact.metadata))
        with self._lock:
            return self._open().execute(f"SELECT count(*) FROM facts{clause}", params).fetchone()[0]

    # -- plumbing --------------------------------------------------------------------------

    def _open(self) -> Connection:
        if self._conn is None:
            raise KvmemError(f"the fact store at {self._dialect.where} is closed")
        return self._conn

    @contextmanager
    def _tx(self) -> Iterator[Connection]:
        with self._lock:
            conn = self._open()
            self._dialect.begin(conn)
            try:
                yield conn
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise

    def _added(self, conn: Connection, result: tuple[FactRecord, bool]) -> tuple[FactRecord, bool]:
        fact, created = result
        if created:
            self._dialect.changed(conn, "add", {"id": fact.id, "user_id": fact.user_id})
        return result

    def _forgotten(self) -> None:
        with self._lock:
            self._dialect.forgotten(self._open())

    def _columns(self, columns: str, where: str) -> Iterator[Mapping[str, Any]]:
        """Every row matching `where`, in rowid order, read in chunks (the lock is not held between)."""
        query = f"SELECT rowid, {columns} FROM facts WHERE {where} AND rowid > ? ORDER BY rowid LIMIT ?"
        after = 0
        while True:
            with self._lock:
                rows = self._open().execute(query, (after, _CHUNK)).fetchall()
            yield from rows
            if len(rows) < _CHUNK:
                return
            after = rows[-1]["rowid"]

    def _scan(self, clause: str, params: builtins.list[str]) -> Iterator[FactRecord]:
        # Keyset paging rather than one cursor: the lock is released between chunks, and the
        # caller's `where` runs outside it (it may call back into the store).
        joiner = " AND " if clause else " WHERE "
        query = (
            f"SELECT rowid, {COLUMNS} FROM facts{clause}{joiner}(created_at, rowid) > (?, ?)"
            " ORDER BY created_at, rowid LIMIT ?"
        )
        after: tuple[float, int] = (float("-inf"), 0)
        while True:
            with self._lock:
                rows = self._open().execute(query, (*params, *after, _CHUNK)).fetchall()
            yield from (record(row) for row in rows)
            if len(rows) < _CHUNK:
                return
            after = (rows[-1]["created_at"], rows[-1]["rowid"])
