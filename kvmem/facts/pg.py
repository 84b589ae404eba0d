"""The PostgreSQL dialect, for deployments where several gateway processes share one database.

`PgFactStore` is `FactStore` (same API, validation, errors and SQL, run through a psycopg adapter
that speaks its `?`/`:name` placeholders) on `PgDialect`. What differs from SQLite, and why:

* Writes are serialized across processes. Every write transaction takes a transaction-level
  advisory lock (`pg_advisory_xact_lock(LOCK_KEY)`) right after BEGIN, as SQLite's BEGIN
  IMMEDIATE takes its write lock: the dedupe read `add` does first stays true until it
  commits, so two processes adding the same text in one scope make one fact (the unique index
  is the backstop). The lock is released by COMMIT or ROLLBACK, also when a client dies.
  Reads take no lock; each runs in autocommit, like SQLite's readers.
* A change feed. Inside each write transaction, `pg_notify('kvmem_facts', json)` is sent for
  every fact it adds, updates (text, metadata, embedding) or deletes, and once for `reset`.
  PostgreSQL delivers notifications only at commit, in commit order, and never those of a
  rolled-back transaction. KV-status and usage bookkeeping do not notify. `subscribe` listens.
* Listings order by `(created_at, rowid)`, as on SQLite; PostgreSQL has no rowid, so the facts
  table has an identity column named `rowid`. Writes being serialized, it grows in commit order.
* The schema's types (schema.POSTGRES): times are DOUBLE PRECISION (REAL is float4 here),
  vectors BYTEA, counters BIGINT (SQLite's INTEGER is 64-bit). The schema version lives in
  table `kvmem_meta`; a newer one is refused.
* A dropped connection (server restart, pg_terminate_backend) is re-opened on the next call.
  A call that starts on a dead connection is retried once on a fresh one when nothing of it can
  have applied (a read, or the BEGIN of a write); a write whose connection dies mid-transaction
  raises StoreUnavailableError and was rolled back by the server. Only a loss during COMMIT
  itself leaves the outcome unknown, as with any database client. A server that cannot be
  reached, or refuses a statement for lack of resources (SQLSTATE class 53: disk full, out of
  memory, too many connections; 57: shutting down), raises StoreUnavailableError too: the
  HTTP server answers 503 with Retry-After (tests/faults/test_storage_faults.py).
* PostgreSQL text cannot hold NUL characters: a context or text with one is refused
  (InvalidInputError), where SQLite would store it.

Forgetting is weaker than on SQLite, and this is the honest part. SQLite's secure_delete zeroes
a deleted row's bytes at once. PostgreSQL's DELETE and UPDATE leave the old row versions (dead
tuples) in the table and index files, and the WAL keeps them until its segments are recycled,
until VACUUM reclaims the space; even then the bytes are only marked reusable, not overwritten.
The store still deletes the fact, scrubs its text from history and drops its usage, so no query
sees it again. An operator who must make deleted text unrecoverable on disk keeps autovacuum on
(the default) and runs `VACUUM` (or `VACUUM FULL facts, history`, which rewrites the files) after
deletions, with backups, replicas and archived WAL treated as holding the old text too.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from functools import lru_cache
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg import pq
from psycopg.conninfo import conninfo_to_dict

from kvmem.errors import InvalidInputError, KvmemError, StoreUnavailableError
from kvmem.facts import schema
from kvmem.facts.dialect import Connection
from kvmem.facts.records import SCHEMA_VERSION
from kvmem.facts.store import FactStore

log = logging.getLogger(__name__)

CHANNEL = "kvmem_facts"
LOCK_KEY = 0x6B766D656D  # "kvmem" in ASCII: the one advisory lock every writer of these tables takes
_CONNECT_TIMEOUT_S = 10
_MAX_PAYLOAD = 8000  # bytes: PostgreSQL refuses a longer notification
_POLL_S = 0.25  # how often a listener looks at its stop flag
_BACKOFF_S = (0.1, 5.0)  # a listener's reconnect delay: first, longest
_MIGRATIONS = (
    "ALTER TABLE facts ADD COLUMN IF NOT EXISTS origin TEXT NOT NULL DEFAULT ''",  # schema 2 -> 3
    "ALTER TABLE facts ADD COLUMN IF NOT EXISTS expires_at DOUBLE PRECISION",  # schema 3 -> 4
)
_HISTORY_MIGRATIONS = ("ALTER TABLE history ADD COLUMN IF NOT EXISTS source TEXT",)  # schema 4 -> 5


class PgFactStore(FactStore):
    """FactStore on the PostgreSQL database at `url` (postgresql://user:password@host:port/dbname)."""

    def __init__(self, url: str) -> None:
        if not isinstance(url, str) or not url:
            raise InvalidInputError(f"database url must be a non-empty string, got {url!r}", param="database_url")
        self.url = url
        self._attach(PgDialect(url))


class PgDialect:
    """What FactStore needs of PostgreSQL (see the module docstring), on one connection."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.where = _redacted(url)
        self._listeners: list[_Listener] = []

    def connect(self) -> Connection:
        conn = _PgConnection(self.url)
        try:
            self._create_schema(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    def begin(self, conn: Connection) -> None:
        conn.execute("BEGIN")
        conn.execute("SELECT pg_advisory_xact_lock(?)", (LOCK_KEY,))

    def changed(self, conn: Connection, op: str, fact: Mapping[str, Any] | None) -> None:
        change = {"op": op} if fact is None else {"op": op, "id": fact["id"], "user_id": fact["user_id"]}
        payload = json.dumps(change, ensure_ascii=False)
        if len(payload.encode("utf-8")) >= _MAX_PAYLOAD:
            payload = '{"op": "resync"}'  # a huge user id: subscribers reload rather than the write fail
        conn.execute("SELECT pg_notify(?, ?)", (CHANNEL, payload))

    def forgotten(self, conn: Connection) -> None:
        """Nothing to do: PostgreSQL has no per-store WAL file to truncate (see the module docstring)."""

    def subscribe(self, callback: Callable[[dict[str, Any]], None]) -> Callable[[], None]:
        # Listening before this returns: no change committed after it slips by.
        listener = _Listener(self.url, callback, self._listeners)
        listener.start()
        return listener.stop

    def stop_feeds(self) -> None:
        for listener in list(self._listeners):
            listener.stop()

    def close(self, conn: Connection) -> None:
        conn.close()

    def _create_schema(self, conn: Connection) -> None:
        # Under the writers' lock, so two processes starting at once do not race CREATE TABLE.
        self.begin(conn)
        try:
            self._migrate(conn)
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    def _migrate(self, conn: Connection) -> None:
        conn.execute("CREATE TABLE IF NOT EXISTS kvmem_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        row = conn.execute("SELECT value FROM kvmem_meta WHERE key = 'schema_version'").fetchone()
        version = 0 if row is None else int(row[0])
        if version > SCHEMA_VERSION:
            raise KvmemError(f"{self.where} was written by a newer kvmem (schema {version} > {SCHEMA_VERSION})")
        if version == SCHEMA_VERSION:
            return  # no DDL on every start: it locks the tables, and may need rights a gateway lacks
        facts, *rest = schema.statements(schema.POSTGRES)
        # An old table gains its columns before their indexes; history exists once `rest` ran.
        for statement in (facts, *_MIGRATIONS, *rest, *_HISTORY_MIGRATIONS):
            conn.execute(statement)
        conn.execute("INSERT INTO kvmem_meta (key, value) VALUES ('schema_version', ?) ON CONFLICT (key)"
                     " DO UPDATE SET value = excluded.value", (str(SCHEMA_VERSION),))


class _Row(dict):
    """A result row readable by column name (it is a dict) and by index, as sqlite3.Row is."""

    def __init__(self, names: list[str], values: tuple) -> None:
        super().__init__(zip(names, values))
        self._values = values

    def __getitem__(self, key: Any) -> Any:
        return self._values[key] if isinstance(key, int) else super().__getitem__(key)


def _row_factory(cursor: Any) -> Callable[[tuple], _Row]:
    names = [column.name for column in cursor.description or ()]
    return lambda values: _Row(names, values)


@lru_cache(maxsize=256)
def _translate(sql: str) -> str:
    """`?` -> %s, `:name` -> %(name)s outside string literals; every % -> %% (psycopg looks for
    its placeholders everywhere, quoted or not)."""

    def one(match: re.Match) -> str:
        token = match.group(0)
        if token.startswith("'"):
            return token.replace("%", "%%")
        if token == "?":
            return "%s"
        if token == "%":
            return "%%"
        return f"%({match.group(1)})s"

    return re.sub(r"'(?:[^']|'')*'|\?|%|(?<!:):([A-Za-z_]\w*)", one, sql)


class _PgConnection:
    """The `Connection` (dialect.py) FactStore's SQL runs on, over one psycopg connection (used
    under the store's lock). Autocommit, so reads need no transaction; writes send BEGIN/COMMIT themselves.
    Client-side binding (ClientCursor): parameters are quoted into the SQL text, so PostgreSQL
    never has to infer a parameter's type (it cannot in `SELECT ?, ? WHERE EXISTS ...`)."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._raw: psycopg.Connection | None = _connect(url)

    @property
    def in_transaction(self) -> bool:
        raw = self._raw
        status = None if raw is None or raw.broken else raw.info.transaction_status
        return status in (pq.TransactionStatus.INTRANS, pq.TransactionStatus.INERROR)

    def execute(self, sql: str, params: Any = ()) -> psycopg.ClientCursor:
        return self._run(lambda cursor: cursor.execute(_translate(sql), params))

    def executemany(self, sql: str, params: Iterable[Any]) -> psycopg.ClientCursor:
        return self._run(lambda cursor: cursor.executemany(_translate(sql), params))

    def close(self) -> None:
        if self._raw is not None:
            self._raw.close()
            self._raw = None

    def _run(self, action: Callable[[psycopg.ClientCursor], Any]) -> Any:
        raw = self._live()
        # Outside a transaction nothing can be half-done: a statement that found the connection
        # dead (a read, or BEGIN) is safely sent again on a fresh one.
        idle = raw.info.transaction_status == pq.TransactionStatus.IDLE
        try:
            return self._do(raw, action)
        except psycopg.OperationalError as e:
            if not raw.broken:  # the server refused it (disk full, too many connections): rolled back
                raise StoreUnavailableError(f"PostgreSQL at {_redacted(self._url)} refused the statement: {e}") from e
            if not idle:
                raise _lost(self._url, e) from e
            log.warning("fact store connection to %s lost (%s); reconnecting", _redacted(self._url), e)
            try:
                return self._do(self._live(), action)
            except psycopg.OperationalError as again:
                raise _lost(self._url, again) from again

    @staticmethod
    def _do(raw: psycopg.Connection, action: Callable[[psycopg.ClientCursor], Any]) -> Any:
        cursor = raw.cursor()
        try:
            action(cursor)
        except psycopg.DataError as e:  # e.g. a NUL character, which PostgreSQL text cannot hold
            # param None: the driver does not say which of the statement's values it refused.
            raise InvalidInputError(f"PostgreSQL refused a value: {e}", param=None) from None
        return cursor  # its rows are already on the client: fetching needs no connection

    def _live(self) -> psycopg.Connection:
        if self._raw is None or self._raw.broken or self._raw.closed:
            if self._raw is not None:
                self._raw.close()
            self._raw = None  # stays None if the reconnect fails: the next call tries again
            self._raw = _connect(self._url)
        return self._raw


def _connect(url: str) -> psycopg.Connection:
    try:
        # A connect_timeout in the url wins; without one, a dead host would block for minutes.
        timeout = {} if "connect_timeout" in conninfo_to_dict(url) else {"connect_timeout": _CONNECT_TIMEOUT_S}
        return psycopg.connect(url, autocommit=True, cursor_factory=psycopg.ClientCursor,
                               row_factory=_row_factory, **timeout)
    except psycopg.OperationalError as e:
        raise StoreUnavailableError(f"cannot connect to PostgreSQL at {_redacted(url)}: {e}") from e
    except psycopg.ProgrammingError as e:  # a url libpq cannot parse
        raise InvalidInputError(f"bad database url {_redacted(url)}: {e}", param="database_url") from None


def _lost(url: str, error: Exception) -> StoreUnavailableError:
    return StoreUnavailableError(f"lost the connection to PostgreSQL at {_redacted(url)} (a write in progress "
                                 f"was rolled back, unless it was lost during COMMIT; the next call reconnects): {error}")


def _redacted(url: str) -> str:
    """The url without its password, for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{parts.username}:***@{host}"))


class _Listener:
    """One subscription: a daemon thread LISTENing on its own autocommit connection."""

    def __init__(self, url: str, callback: Callable[[dict[str, Any]], None], registry: list[_Listener]) -> None:
        self._url = url
        self._callback = callback
        self._registry = registry
        self._stopping = threading.Event()
        self._conn: psycopg.Connection | None = self._listen()  # before returning: no change slips by
        self._thread = threading.Thread(target=self._run, name="kvmem-facts-listener", daemon=True)
        registry.append(self)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self in self._registry:
            self._registry.remove(self)
        if threading.current_thread() is not self._thread and self._thread.is_alive():
            self._thread.join()

    def _listen(self) -> psycopg.Connection:
        conn = _connect(self._url)
        try:
            conn.execute(f"LISTEN {CHANNEL}")
        except psycopg.Error as e:
            conn.close()
            raise KvmemError(f"cannot LISTEN on PostgreSQL at {_redacted(self._url)}: {e}") from e
        return conn

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                for note in self._notes():
                    self._deliver(note.payload)
        finally:
            if self._conn is not None:
                self._conn.close()

    def _notes(self) -> Iterator[psycopg.Notify]:
        """What arrives within one poll; after a lost connection, reconnects and tells of a resync."""
        try:
            if self._conn is None:
                self._reconnect()
                if self._conn is None:
                    return
            yield from self._conn.notifies(timeout=_POLL_S)
        except psycopg.Error as e:
            log.warning("fact change feed lost its connection (%s); reconnecting", e)
            self._conn.close()
            self._conn = None

    def _reconnect(self) -> None:
        delay = _BACKOFF_S[0]
        while not self._stopping.wait(delay):
            try:
                self._conn = self._listen()
            except KvmemError as e:
                log.warning("fact change feed: %s; retrying in %.1f s", e, delay)
                delay = min(delay * 2, _BACKOFF_S[1])
                continue
            self._deliver('{"op": "resync"}')  # changes made while it was away were not seen
            return

    def _deliver(self, payload: str) -> None:
        try:
            self._callback(json.loads(payload))
        except Exception:  # one bad callback (or a stranger's payload) must not end the feed
            log.exception("fact change feed: delivering %s failed", payload)
