"""The durable fact store: facts, their history and their embeddings in one SQLite file.

Design, in the spirit of Mem0's storage:

* WAL journal with `synchronous=FULL`: readers never block the writer, and a committed
  fact survives a crash or power cut. One connection is shared by all threads behind a
  lock; SQLite allows a single writer anyway, and the lock keeps Python's sqlite3 objects
  from being used by two threads at once. Multi-statement writes run in one
  `BEGIN IMMEDIATE` transaction, so they apply whole or not at all.
* Forgetting is real. `secure_delete=ON` makes SQLite zero the bytes of deleted rows
  instead of leaving them in free space; a delete also scrubs the fact's text from every
  earlier history event (the events stay, so the audit trail still says what happened
  and when), and ends with a TRUNCATE checkpoint so the text is not left in the -wal file.
* Vectors live in the same file as the facts, not in a separate index file: one durable
  place, written in the same transactions, so vectors, facts and history can never
  disagree after a crash. The in-memory vector index is rebuilt from `embeddings()` at
  start-up.
* De-duplication is per scope on a hash of the normalized text (Unicode NFC, runs of
  whitespace collapsed; case is kept), enforced by a unique index as well as by `add`.

The same store on PostgreSQL, for several processes sharing one database, is `pg.PgFactStore`:
it reuses this class's code through the small `Connection` interface below.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sqlite3
import threading
import time
import unicodedata
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, fields
from datetime import datetime
from itertools import islice
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from kvmem.errors import InvalidInputError, KvmemError, UnknownFactError
from kvmem.facts.scope import Scope, check_scope_field
from kvmem.facts.text import check_fact_text, check_nested
from kvmem.kv.store import check_fact_id

log = logging.getLogger(__name__)

KV_STATUSES = ("pending", "encoded", "failed", "evicted")
SOURCES = ("fact", "messages")
MAX_LIMIT = 10_000
MAX_OFFSET = (1 << 63) - 1  # SQLite's largest integer: OFFSET overflows beyond it
SCHEMA_VERSION = 3  # 2: kv_status 'evicted', table kv_usage; 3: column origin
_CHUNK = 1000  # rows per lock hold when streaming, so long scans never starve writers


class Connection(Protocol):
    """What the SQL helpers below need of a connection: sqlite3's, or pg.py's psycopg adapter.

    SQL is written with `?` and `:name` placeholders; rows read by column name and by index.
    """

    in_transaction: bool

    def execute(self, sql: str, params: Any = ..., /) -> Any: ...

    def executemany(self, sql: str, params: Iterable[Any], /) -> Any: ...


_SCHEMA = """
CREATE TABLE IF NOT EXISTS facts (
    id TEXT PRIMARY KEY,
    scope_key TEXT NOT NULL,
    user_id TEXT NOT NULL,
    agent_id TEXT,
    run_id TEXT,
    text TEXT NOT NULL,
    metadata TEXT NOT NULL,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    source TEXT NOT NULL CHECK (source IN ('fact', 'messages')),
    event_time TEXT,
    context TEXT NOT NULL,
    position INTEGER,
    conversation_id TEXT,
    content_hash TEXT NOT NULL,
    kv_status TEXT NOT NULL CHECK (kv_status IN ('pending', 'encoded', 'failed', 'evicted')),
    kv_attempts INTEGER NOT NULL,
    embedding BLOB,
    embedding_dim INTEGER,
    origin TEXT NOT NULL DEFAULT ''
);
CREATE UNIQUE INDEX IF NOT EXISTS facts_scope_hash ON facts (scope_key, content_hash);
CREATE INDEX IF NOT EXISTS facts_order ON facts (created_at);
CREATE INDEX IF NOT EXISTS facts_user_order ON facts (user_id, created_at);
CREATE INDEX IF NOT EXISTS facts_kv ON facts (kv_status, kv_attempts, created_at);
CREATE TABLE IF NOT EXISTS history (
    id INTEGER PRIMARY KEY,
    fact_id TEXT NOT NULL,
    event TEXT NOT NULL CHECK (event IN ('ADD', 'UPDATE', 'DELETE')),
    old_text TEXT,
    new_text TEXT,
    at REAL NOT NULL,
    scope_key TEXT NOT NULL,
    user_id TEXT NOT NULL,
    agent_id TEXT,
    run_id TEXT
);
CREATE INDEX IF NOT EXISTS history_fact ON history (fact_id, id);
CREATE TABLE IF NOT EXISTS kv_usage (
    fact_id TEXT PRIMARY KEY,
    hits INTEGER NOT NULL
);
"""


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

    @property
    def scope(self) -> Scope:
        return Scope(self.user_id, self.agent_id, self.run_id)

    def __eq__(self, other: object) -> bool:
        # Written by hand because == on numpy arrays is elementwise, not a bool.
        if not isinstance(other, FactRecord):
            return NotImplemented
        return all(_same(getattr(self, f), getattr(other, f)) for f in _FIELDS)


@dataclass(frozen=True)
class HistoryEvent:
    fact_id: str
    event: str  # "ADD" | "UPDATE" | "DELETE"
    old_text: str | None  # None after the fact is deleted
    new_text: str | None
    at: float
    user_id: str | None = None  # whose fact it was: lets callers check ownership after a delete


_FIELDS = tuple(f.name for f in fields(FactRecord))
_COLUMNS = ", ".join(_FIELDS)
_ADD_KEYS = frozenset(
    {"scope", "text", "metadata", "source", "context", "event_time", "position", "conversation_id", "embedding",
     "origin"}
    | {"fact_id"}
)


def content_hash(text: str) -> str:
    """sha256 of the text with Unicode and whitespace differences normalized away."""
    normalized = unicodedata.normalize("NFC", " ".join(text.split()))
    return hashlib.sha256(normalized.encode("utf-8")).hexdigest()


class FactStore:
    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._conn: Connection | None = _connect(self.path)

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
        row = _new_row(
            scope, text, metadata=metadata, source=source, context=context, event_time=event_time,
            position=position, conversation_id=conversation_id, embedding=embedding, fact_id=fact_id, origin=origin,
        )  # fmt: skip
        with self._tx() as conn:
            return self._added(conn, _insert(conn, row))

    def add_many(self, items: Iterable[Mapping[str, Any]]) -> list[tuple[FactRecord, bool]]:
        """`add` for each item (dicts of add's argument names), all in one transaction."""
        rows = [_new_row(**_check_item(item)) for item in items]
        with self._tx() as conn:
            return [self._added(conn, _insert(conn, row)) for row in rows]

    def update(
        self, fact_id: str, text: str, *, metadata: dict[str, Any] | None = None, embedding: Any = None
    ) -> FactRecord:
        """New text (and optionally new metadata, replacing the old, and embedding)."""
        text = _check_text(text)
        meta = None if metadata is None else _metadata_json(metadata)
        vec = _as_vector(embedding)
        digest = content_hash(text)
        with self._tx() as conn:
            old = _fetch(conn, fact_id)
            _refuse_duplicate(conn, old, digest)
            changes: dict[str, Any] = {} if meta is None else {"metadata": meta}
            if text != old["text"]:
                # The KV blob and the embedding were made from the old words: both must be remade.
                changes.update(text=text, content_hash=digest, kv_status="pending", kv_attempts=0)
                changes.update(embedding=None, embedding_dim=None)
            if vec is not None:
                changes.update(embedding=_vector_blob(vec), embedding_dim=vec.size)
            changes = {k: v for k, v in changes.items() if old[k] != v}
            if changes:
                now = changes["updated_at"] = time.time()
                _set(conn, fact_id, changes)
                _log(conn, "UPDATE", old, old["text"], text, now)
                self._changed(conn, "update", old)
            return _record(_fetch(conn, fact_id))

    def delete(self, fact_id: str) -> FactRecord:
        """Forget one fact; returns it as it was."""
        with self._tx() as conn:
            row = _fetch(conn, fact_id)
            _forget(conn, [row])
            self._changed(conn, "delete", row)
        self._checkpoint()
        return _record(row)

    def delete_scope(
        self, scope: Scope | str, *, agent_id: str | None = None, run_id: str | None = None
    ) -> list[str]:
        """Forget every fact of a user, narrowed by agent_id/run_id where given; returns their ids.

        A Scope is read the same way: Scope("u") deletes all of u's facts, whatever their agent or run.
        """
        if isinstance(scope, Scope):
            if agent_id is not None or run_id is not None:
                raise InvalidInputError("give agent_id/run_id inside the Scope or as arguments, not both")
            scope, agent_id, run_id = scope.user_id, scope.agent_id, scope.run_id
        clause, params = _filters(scope, agent_id, run_id, user_required=True)
        with self._tx() as conn:
            rows = conn.execute(f"SELECT {_COLUMNS} FROM facts{clause} ORDER BY created_at, rowid", params).fetchall()
            _forget(conn, rows)
            for row in rows:
                self._changed(conn, "delete", row)
        if rows:
            self._checkpoint()
        return [row["id"] for row in rows]

    def set_kv_status(self, fact_id: str, status: str, *, if_text: str | None = None) -> bool:
        """Record the KV encoder's outcome; 'failed' counts an attempt.

        With `if_text`, nothing is written (and False returned) unless the fact still has that
        text, so an encoder that raced an update cannot mark the new text as encoded.
        """
        if status not in KV_STATUSES:
            raise InvalidInputError(f"kv status must be one of {KV_STATUSES}, got {status!r}")
        with self._tx() as conn:
            if not _still(_fetch(conn, fact_id), if_text):
                return False
            failed = int(status == "failed")
            conn.execute(
                "UPDATE facts SET kv_status = ?, kv_attempts = kv_attempts + ? WHERE id = ?", (status, failed, fact_id)
            )
        return True

    def set_embedding(self, fact_id: str, vec: Any, *, if_text: str | None = None) -> bool:
        """Store (or, with None, clear) a fact's embedding; `if_text` guards as in set_kv_status."""
        arr = _as_vector(vec)
        blob, dim = (None, None) if arr is None else (_vector_blob(arr), arr.size)
        with self._tx() as conn:
            row = _fetch(conn, fact_id)
            if not _still(row, if_text):
                return False
            conn.execute("UPDATE facts SET embedding = ?, embedding_dim = ? WHERE id = ?", (blob, dim, fact_id))
            self._changed(conn, "update", row)
        return True

    def reset(self) -> None:
        """Drop every fact and all history."""
        with self._tx() as conn:
            conn.execute("DELETE FROM facts")
            conn.execute("DELETE FROM history")
            conn.execute("DELETE FROM kv_usage")
            self._changed(conn, "reset", None)
        self._checkpoint()

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
        with self._lock:
            if self._conn is None:
                return
            self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            self._conn.close()
            self._conn = None

    def subscribe(self, callback: Callable[[dict[str, Any]], None]) -> Callable[[], None]:
        """Call `callback` with each change other processes commit; returns a function that stops it.

        A SQLite store is one process's file (WAL allows no writers on other machines, and kvmem
        opens it from one process), so nothing else can change it: this does nothing and returns
        a no-op. PgFactStore, shared by several processes, overrides it with a real change feed.
        """
        self._open()  # a closed store refuses, as every other call does
        return _nothing

    def __enter__(self) -> FactStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reading ---------------------------------------------------------------------------

    def get(self, fact_id: str) -> FactRecord:
        with self._lock:
            return _record(_fetch(self._open(), fact_id))

    def list(
        self,
        *,
        user_id: str | None = None,
        agent_id: str | None = None,
        run_id: str | None = None,
        limit: int = 100,
        offset: int = 0,
        where: Callable[[dict[str, Any]], bool] | None = None,
    ) -> list[FactRecord]:
        """Facts oldest first; `where(metadata)` filters before offset/limit are applied."""
        _check_page(limit, offset)
        clause, params = _filters(user_id, agent_id, run_id)
        if where is None:
            sql = f"SELECT {_COLUMNS} FROM facts{clause} ORDER BY created_at, rowid LIMIT ? OFFSET ?"
            with self._lock:
                rows = self._open().execute(sql, (*params, limit, offset)).fetchall()
            return [_record(row) for row in rows]
        matches = (record for record in self._scan(clause, params) if where(record.metadata))
        return [*islice(matches, offset, offset + limit)]

    def history(self, fact_id: str) -> list[HistoryEvent]:
        """Every event of a fact, oldest first, also after it was deleted (texts scrubbed then)."""
        sql = "SELECT fact_id, event, old_text, new_text, at, user_id FROM history WHERE fact_id = ? ORDER BY id"
        with self._lock:
            rows = self._open().execute(sql, (_id(fact_id),)).fetchall()
        if not rows:
            raise UnknownFactError(fact_id)
        return [HistoryEvent(**dict(row)) for row in rows]

    def pending(self, limit: int = 100, *, max_attempts: int | None = None) -> list[FactRecord]:
        """Facts whose KV is not encoded yet, least-tried first, then oldest first."""
        _check_page(limit, 0)
        where, params = _pending_where(max_attempts)
        sql = f"SELECT {_COLUMNS} FROM facts{where} ORDER BY kv_attempts, created_at, rowid LIMIT ?"
        with self._lock:
            rows = self._open().execute(sql, (*params, limit)).fetchall()
        return [_record(row) for row in rows]

    def count_pending(self, *, max_attempts: int | None = None) -> int:
        """How many facts `pending` would return without a limit."""
        where, params = _pending_where(max_attempts)
        with self._lock:
            return self._open().execute(f"SELECT COUNT(*) FROM facts{where}", params).fetchone()[0]

    def embeddings(self) -> Iterator[tuple[str, str, np.ndarray, dict[str, Any]]]:
        """(fact_id, scope_key, vector, metadata) of every fact that has an embedding."""
        for row in self._columns("id, scope_key, embedding, metadata", "embedding IS NOT NULL"):
            yield row["id"], row["scope_key"], _vector_from(row["embedding"]), json.loads(row["metadata"])

    def texts(self) -> Iterator[tuple[str, str, str, str, str, dict[str, Any]]]:
        """(fact_id, scope_key, text, context, origin, metadata) of every fact."""
        for row in self._columns("id, scope_key, text, context, origin, metadata", "TRUE"):
            yield (row["id"], row["scope_key"], row["text"], row["context"], row["origin"],
                   json.loads(row["metadata"]))

    def _columns(self, columns: str, where: str) -> Iterator[Mapping[str, Any]]:
        """Every row matching `where`, in rowid order, read in chunks (the lock is not held between)."""
        sql = f"SELECT rowid, {columns} FROM facts WHERE {where} AND rowid > ? ORDER BY rowid LIMIT ?"
        after = 0
        while True:
            with self._lock:
                rows = self._open().execute(sql, (after, _CHUNK)).fetchall()
            yield from rows
            if len(rows) < _CHUNK:
                return
            after = rows[-1]["rowid"]

    def count(self, user_id: str | None = None, agent_id: str | None = None, run_id: str | None = None) -> int:
        clause, params = _filters(user_id, agent_id, run_id)
        with self._lock:
            return self._open().execute(f"SELECT count(*) FROM facts{clause}", params).fetchone()[0]

    # -- plumbing --------------------------------------------------------------------------

    def _open(self) -> Connection:
        if self._conn is None:
            raise KvmemError(f"the fact store at {self.path} is closed")
        return self._conn

    @contextmanager
    def _tx(self) -> Iterator[Connection]:
        with self._lock:
            conn = self._open()
            self._begin(conn)
            try:
                yield conn
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise

    def _begin(self, conn: Connection) -> None:
        # IMMEDIATE takes the write lock now, so the reads a write does first (dedupe) stay true.
        conn.execute("BEGIN IMMEDIATE")

    def _added(self, conn: Connection, result: tuple[FactRecord, bool]) -> tuple[FactRecord, bool]:
        record, created = result
        if created:
            self._changed(conn, "add", {"id": record.id, "user_id": record.user_id})
        return result

    def _changed(self, conn: Connection, op: str, fact: Mapping[str, Any] | None) -> None:
        """Called inside the write transaction for each fact it changes (None: all of them, reset).
        A hook for PgFactStore's change feed; one SQLite file has no one else to tell."""

    def _checkpoint(self) -> None:
        with self._lock:
            busy = self._open().execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]
        if busy:
            # Another connection (another process) is reading; the next checkpoint will finish the job.
            log.warning("WAL checkpoint of %s blocked; deleted text stays in its -wal file until the next", self.path)

    def _scan(self, clause: str, params: list[str]) -> Iterator[FactRecord]:
        # Keyset paging rather than one cursor: the lock is released between chunks, and the
        # caller's `where` runs outside it (it may call back into the store).
        joiner = " AND " if clause else " WHERE "
        sql = (
            f"SELECT rowid, {_COLUMNS} FROM facts{clause}{joiner}(created_at, rowid) > (?, ?)"
            " ORDER BY created_at, rowid LIMIT ?"
        )
        after: tuple[float, int] = (float("-inf"), 0)
        while True:
            with self._lock:
                rows = self._open().execute(sql, (*params, *after, _CHUNK)).fetchall()
            yield from (_record(row) for row in rows)
            if len(rows) < _CHUNK:
                return
            after = (rows[-1]["created_at"], rows[-1]["rowid"])


# -- SQL helpers (called with the store's lock held) ------------------------------------------


def _connect(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, timeout=30.0, isolation_level=None, check_same_thread=False)
    conn.row_factory = sqlite3.Row
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        conn.close()
        raise KvmemError(f"{path} was written by a newer kvmem (schema {version} > {SCHEMA_VERSION})")
    if conn.execute("PRAGMA journal_mode=WAL").fetchone()[0].lower() != "wal":
        log.warning("%s: SQLite refused WAL mode (network filesystem?); falling back to its default", path)
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("PRAGMA secure_delete=ON")  # per connection, so set on every open
    if version == 1:
        _migrate_v1(conn)
    if version in (1, 2):
        _migrate_v2(conn)
    conn.executescript(_SCHEMA)
    conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
    return conn


def _migrate_v1(conn: sqlite3.Connection) -> None:
    """Schema 1 -> 2: kv_status may be 'evicted'. SQLite cannot alter a CHECK constraint, so the
    facts table is rebuilt (rowids kept: listings order by them), in one transaction."""
    table = _SCHEMA.split("CREATE TABLE IF NOT EXISTS facts (", 1)[1].split(");", 1)[0]
    columns = ", ".join(f for f in _FIELDS if f != "origin")  # schema 3's column comes with its default
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.execute(f"CREATE TABLE facts_v2 ({table})")
        conn.execute(f"INSERT INTO facts_v2 (rowid, {columns}) SELECT rowid, {columns} FROM facts")
        conn.execute("DROP TABLE facts")  # its indexes go with it; _SCHEMA recreates them
        conn.execute("ALTER TABLE facts_v2 RENAME TO facts")
        conn.execute("PRAGMA user_version=2")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    log.info("fact store migrated to schema 2 (kv_status 'evicted')")


def _migrate_v2(conn: sqlite3.Connection) -> None:
    """Schema 2 -> 3: column origin ('' for every stored fact). A v1 store rebuilt just now has it."""
    if "origin" not in {row["name"] for row in conn.execute("PRAGMA table_info(facts)")}:
        conn.execute("ALTER TABLE facts ADD COLUMN origin TEXT NOT NULL DEFAULT ''")
        log.info("fact store migrated to schema 3 (column origin)")


def _fetch(conn: Connection, fact_id: str) -> Mapping[str, Any]:
    row = conn.execute(f"SELECT {_COLUMNS} FROM facts WHERE id = ?", (_id(fact_id),)).fetchone()
    if row is None:
        raise UnknownFactError(fact_id)
    return row


def _still(row: Mapping[str, Any], if_text: str | None) -> bool:
    return if_text is None or row["text"] == if_text


def _insert(conn: Connection, row: dict[str, Any]) -> tuple[FactRecord, bool]:
    sql = f"SELECT {_COLUMNS} FROM facts WHERE scope_key = ? AND content_hash = ?"
    existing = conn.execute(sql, (row["scope_key"], row["content_hash"])).fetchone()
    if existing is not None:
        return _record(existing), False
    # An id seen in history too: reusing a deleted fact's id would splice two facts' histories.
    used = "SELECT 1 FROM facts WHERE id = ? UNION ALL SELECT 1 FROM history WHERE fact_id = ? LIMIT 1"
    if conn.execute(used, (row["id"], row["id"])).fetchone():
        raise InvalidInputError(f"fact id {row['id']!r} is already in use")
    row["created_at"] = row["updated_at"] = time.time()
    conn.execute(f"INSERT INTO facts ({_COLUMNS}) VALUES ({', '.join(':' + f for f in _FIELDS)})", row)
    _log(conn, "ADD", row, None, row["text"], row["created_at"])
    return _record(row), True


def _set(conn: Connection, fact_id: str, changes: dict[str, Any]) -> None:
    assignments = ", ".join(f"{name} = :{name}" for name in changes)  # names are ours, never the caller's
    conn.execute(f"UPDATE facts SET {assignments} WHERE id = :_id", {**changes, "_id": fact_id})


def _refuse_duplicate(conn: Connection, old: Mapping[str, Any], digest: str) -> None:
    sql = "SELECT id FROM facts WHERE scope_key = ? AND content_hash = ? AND id <> ?"
    clash = conn.execute(sql, (old["scope_key"], digest, old["id"])).fetchone()
    if clash is not None:
        raise InvalidInputError(f"fact text duplicates fact {clash['id']!r} in the same scope")


def _forget(conn: Connection, rows: Iterable[Mapping[str, Any]]) -> None:
    now = time.time()
    for row in rows:
        # Earlier events keep what happened and when, but lose the words.
        conn.execute("UPDATE history SET old_text = NULL, new_text = NULL WHERE fact_id = ?", (row["id"],))
        _log(conn, "DELETE", row, None, None, now)
        conn.execute("DELETE FROM facts WHERE id = ?", (row["id"],))
        conn.execute("DELETE FROM kv_usage WHERE fact_id = ?", (row["id"],))


def _log(
    conn: Connection, event: str, fact: Mapping[str, Any], old: str | None, new: str | None, at: float
) -> None:
    conn.execute(
        "INSERT INTO history (fact_id, event, old_text, new_text, at, scope_key, user_id, agent_id, run_id)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (fact["id"], event, old, new, at, fact["scope_key"], fact["user_id"], fact["agent_id"], fact["run_id"]),
    )


def _filters(
    user_id: str | None, agent_id: str | None, run_id: str | None, *, user_required: bool = False
) -> tuple[str, list[str]]:
    given = {
        "user_id": check_scope_field("user_id", user_id, required=user_required),
        "agent_id": check_scope_field("agent_id", agent_id, required=False),
        "run_id": check_scope_field("run_id", run_id, required=False),
    }
    used = {name: value for name, value in given.items() if value is not None}
    clause = " AND ".join(f"{name} = ?" for name in used)
    return (f" WHERE {clause}" if clause else ""), list(used.values())


# -- validation and conversion ------------------------------------------------------------------


def _new_row(
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
) -> dict[str, Any]:
    if not isinstance(scope, Scope):
        raise InvalidInputError(f"scope must be a Scope, got {type(scope).__name__}")
    text = _check_text(text)
    if source not in SOURCES:
        raise InvalidInputError(f"source must be one of {SOURCES}, got {source!r}")
    if not isinstance(context, str):
        raise InvalidInputError(f"context must be a string, got {type(context).__name__}")
    if not isinstance(origin, str):
        raise InvalidInputError(f"origin must be a string, got {type(origin).__name__}")
    if position is not None and (not _is_int(position) or position < 0):
        raise InvalidInputError(f"position must be None or an int >= 0, got {position!r}")
    vec = _as_vector(embedding)
    return {
        "id": "f-" + uuid.uuid4().hex if fact_id is None else check_fact_id(fact_id),
        "scope_key": scope.key,
        "user_id": scope.user_id,
        "agent_id": scope.agent_id,
        "run_id": scope.run_id,
        "text": text,
        "metadata": _metadata_json(metadata),
        "created_at": None,  # stamped inside the transaction, so time order follows commit order
        "updated_at": None,
        "source": source,
        "event_time": _check_event_time(event_time),
        "context": context,
        "position": position,
        "conversation_id": check_scope_field("conversation_id", conversation_id, required=False),
        "content_hash": content_hash(text),
        "kv_status": "pending",
        "kv_attempts": 0,
        "embedding": None if vec is None else _vector_blob(vec),
        "embedding_dim": None if vec is None else vec.size,
        "origin": origin,
    }


def _check_item(item: object) -> dict[str, Any]:
    if not isinstance(item, Mapping):
        raise InvalidInputError(f"add_many items must be dicts, got {type(item).__name__}")
    unknown = set(item) - _ADD_KEYS
    if unknown:
        raise InvalidInputError(f"add_many item has unknown keys {sorted(map(str, unknown))}")
    if "scope" not in item or "text" not in item:
        raise InvalidInputError("add_many items need 'scope' and 'text'")
    return dict(item)


def _check_text(text: object) -> str:
    return check_fact_text(text, "fact text").strip()


def _metadata_json(metadata: object) -> str:
    if metadata is None:
        return "{}"
    problem = "metadata must be a JSON-serializable dict with str keys"
    if not isinstance(metadata, dict):
        raise InvalidInputError(f"{problem}, got {type(metadata).__name__}")
    check_nested("metadata", metadata)
    try:
        encoded = json.dumps(metadata, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise InvalidInputError(f"{problem}: {e}") from None
    # json.dumps quietly turns int keys into str and tuples into lists; refuse what would not read back as given.
    if json.loads(encoded) != metadata:
        raise InvalidInputError(f"{problem} (and lists, not tuples): it would not read back as given")
    return encoded


def _check_event_time(value: object) -> str | None:
    if value is None:
        return None
    if isinstance(value, datetime):
        return value.isoformat()
    try:
        datetime.fromisoformat(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise InvalidInputError(f"event_time must be None, a datetime or an ISO 8601 string, got {value!r}") from None
    return value  # type: ignore[return-value]


def _check_page(limit: object, offset: object) -> None:
    if not _is_int(limit) or not 1 <= limit <= MAX_LIMIT:  # type: ignore[operator]
        raise InvalidInputError(f"limit must be an int in 1..{MAX_LIMIT}, got {limit!r}")
    if not _is_int(offset) or not 0 <= offset <= MAX_OFFSET:  # type: ignore[operator]
        raise InvalidInputError(f"offset must be an int in 0..{MAX_OFFSET}, got {offset!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _id(fact_id: object) -> str:
    """A fact id to look up: anything that is not valid text cannot name a fact."""
    if not isinstance(fact_id, str):
        raise UnknownFactError(fact_id)  # type: ignore[arg-type]
    try:
        fact_id.encode("utf-8")
    except UnicodeEncodeError:
        raise UnknownFactError(ascii(fact_id)) from None
    if "\x00" in fact_id:  # no fact id holds one (check_fact_id), and PostgreSQL text cannot
        raise UnknownFactError(fact_id)
    return fact_id


def _as_vector(vec: Any) -> np.ndarray | None:
    if vec is None:
        return None
    arr = np.asarray(vec)
    if arr.dtype.kind not in "iuf" or arr.ndim != 1 or arr.size == 0:
        raise InvalidInputError(f"embedding must be a non-empty 1-D array of numbers, got {arr.shape} {arr.dtype}")
    arr = arr.astype(np.float32)
    if not np.isfinite(arr).all():
        raise InvalidInputError("embedding must hold finite float32 numbers")
    return arr


def _vector_blob(vec: np.ndarray) -> bytes:
    return vec.astype("<f4").tobytes()  # fixed byte order: the file may move between machines


def _vector_from(blob: bytes | None) -> np.ndarray | None:
    if blob is None:
        return None
    vec = np.frombuffer(blob, dtype="<f4").astype(np.float32)
    vec.flags.writeable = False
    return vec


def _pending_where(max_attempts: int | None) -> tuple[str, tuple]:
    """The WHERE clause (and its parameters) of facts still waiting for their KV."""
    if max_attempts is None:
        return " WHERE kv_status IN ('pending', 'failed')", ()
    return " WHERE kv_status IN ('pending', 'failed') AND kv_attempts < ?", (max_attempts,)


def _record(row: Mapping[str, Any]) -> FactRecord:
    data = {name: row[name] for name in _FIELDS}
    data["metadata"] = json.loads(data["metadata"])
    data["embedding"] = _vector_from(data["embedding"])
    return FactRecord(**data)


def _nothing() -> None:
    pass


def _same(a: object, b: object) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and np.array_equal(a, b)
    return a == b
