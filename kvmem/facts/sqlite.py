"""The SQLite dialect: one file, WAL, and a lock that keeps other processes from deleting its WAL.

* WAL journal with `synchronous=FULL`: readers never block the writer, and a committed fact
  survives a crash or power cut. BEGIN IMMEDIATE takes the write lock at the start of a write.
* `secure_delete=ON` makes SQLite zero the bytes of deleted rows instead of leaving them in free
  space, and every delete ends with a TRUNCATE checkpoint, so the text is not left in the -wal
  file either.
* Another process may open the file while this one serves it (a CLI next to a server). SQLite's
  locks are POSIX record locks, which belong to a process, not to a connection: closing *any*
  descriptor of the file in this process (a backup, a `Path.read_bytes()`, a copy) silently
  drops all of them. The other process's connection, on closing, then believes it is the last
  one, checkpoints, and deletes the -wal and -shm files under this process's live connection:
  later commits here go to an unlinked WAL that no one else reads, and this process's next
  connection fails with "disk I/O error" or "database disk image is malformed". So each store
  also holds an open file description (OFD) lock on the range SQLite's SHARED lock uses
  (`_Guards`): no close elsewhere can drop it, and it makes another process's last-connection
  check fail for as long as the store is open. Where the platform has no OFD locks (macOS), the
  store runs without one and an in-process close of the file must be avoided.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import struct
import threading
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kvmem.errors import KvmemError
from kvmem.facts import schema
from kvmem.facts.dialect import Connection
from kvmem.facts.records import FIELDS, SCHEMA_VERSION

try:
    import fcntl
except ImportError:  # Windows: no POSIX locks to guard
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger("kvmem.facts.store")  # where the store has always logged

_BUSY_TIMEOUT_S = 30.0
# SQLite's unix VFS: a SHARED lock is a read lock on these bytes, EXCLUSIVE a write lock on them.
_SHARED_FIRST = 0x40000000 + 2  # PENDING_BYTE + 2
_SHARED_SIZE = 510
_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", None)  # Linux only
_FLOCK = struct.Struct("hhqqi")  # struct flock: l_type, l_whence, l_start, l_len, l_pid (0 for OFD locks)


class SqliteDialect:
    """FactStore on the SQLite file at `path` (created with its folder when missing)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.where = str(path)
        self._guard: tuple[int, int] | None = None
        self._unguard: weakref.finalize | None = None

    def connect(self) -> Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = _connect(self.path)
        if conn.execute("PRAGMA journal_mode").fetchone()[0].lower() == "wal":  # rollback mode needs no guard
            self._guard = _GUARDS.hold(self.path)
        if self._guard is not None:
            self._unguard = weakref.finalize(self, _GUARDS.drop, self._guard)
        return conn

    def begin(self, conn: Connection) -> None:
        conn.execute("BEGIN IMMEDIATE")

    def changed(self, conn: Connection, op: str, fact: Mapping[str, Any] | None) -> None:
        """Nothing: no other process hears of a SQLite file's commits (see FactStore.subscribe)."""

    def forgotten(self, conn: Connection) -> None:
        busy = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]
        if busy:
            # Another connection (another process) is reading; the next checkpoint will finish the job.
            log.warning("WAL checkpoint of %s blocked; deleted text stays in its -wal file until the next", self.path)

    def subscribe(self, callback: Callable[[dict[str, Any]], None]) -> Callable[[], None]:
        return _nothing

    def stop_feeds(self) -> None:
        pass

    def close(self, conn: Connection) -> None:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        guard, self._guard = self._guard, None
        if guard is None or self._unguard is None or not self._unguard.detach():
            conn.close()  # unguarded: rollback mode, or a platform without OFD locks
            return
        _GUARDS.release(guard, conn.close)


def _connect(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, timeout=_BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
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
    if version in (1, 2, 3):
        _migrate_v3(conn)
    if version in (1, 2, 3, 4):
        _migrate_v4(conn)
    for statement in schema.statements(schema.SQLITE):
        conn.execute(statement)
    conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
    return conn


def _migrate_v1(conn: sqlite3.Connection) -> None:
    """Schema 1 -> 2: kv_status may be 'evicted'. SQLite cannot alter a CHECK constraint, so the
    facts table is rebuilt (rowids kept: listings order by them), in one transaction."""
    columns = ", ".join(f for f in FIELDS if f not in ("origin", "expires_at"))  # later schemas' columns: defaults
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.execute(schema.facts_table(schema.SQLITE, "facts_v2"))
        conn.execute(f"INSERT INTO facts_v2 (rowid, {columns}) SELECT rowid, {columns} FROM facts")
        conn.execute("DROP TABLE facts")  # its indexes go with it; the schema's statements recreate them
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


def _migrate_v3(conn: sqlite3.Connection) -> None:
    """Schema 3 -> 4: column expires_at (NULL, never, for every stored fact)."""
    if "expires_at" not in {row["name"] for row in conn.execute("PRAGMA table_info(facts)")}:
        conn.execute("ALTER TABLE facts ADD COLUMN expires_at REAL")
        log.info("fact store migrated to schema 4 (column expires_at)")


def _migrate_v4(conn: sqlite3.Connection) -> None:
    """Schema 4 -> 5: history.source (NULL, a caller's write, for every earlier event)."""
    if "source" not in {row["name"] for row in conn.execute("PRAGMA table_info(history)")}:
        conn.execute("ALTER TABLE history ADD COLUMN source TEXT")
        log.info("fact store migrated to schema 5 (history.source)")


class _Guards:
    """This process's OFD locks on its SQLite files (module docstring): one descriptor per file,
    shared by every store of this process on that file.

    The descriptor is closed only after the process's last store of the file has closed its
    connection: closing it earlier would drop the POSIX locks of the connections still open, the
    very harm the guard exists to prevent. A store collected without close() is only noted (a
    finalizer must not wait for a lock) and given back at the next hold or release."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._held: dict[tuple[int, int], list[int]] = {}  # (st_dev, st_ino) -> [descriptor, stores]
        self._dropped: list[tuple[int, int]] = []  # keys of stores collected unclosed

    def forget_after_fork(self) -> None:
        """In a forked child. Its descriptors share the parent's open file descriptions, so their
        locks stay the parent's (closing the child's copies releases nothing), and the child
        holds no POSIX locks yet that a close could drop: close them, start empty (with a fresh
        mutex: another thread may have held the old one at the fork)."""
        for fd, _ in self._held.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._mutex = threading.Lock()
        self._held, self._dropped = {}, []

    def hold(self, path: Path) -> tuple[int, int] | None:
        """Guard the file at `path` for one more store; the key to release it with, or None where
        the platform has no OFD locks."""
        if _OFD_SETLK is None:
            return None
        stat = os.stat(path)  # not open(): a descriptor we had to close again would drop the locks
        key = (stat.st_dev, stat.st_ino)
        with self._mutex:
            self._give_back_dropped()
            if key in self._held:
                self._held[key][1] += 1
                return key
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            self._held[key] = [fd, 1]  # kept even if the lock fails: see the class docstring
            try:
                _ofd_lock(fd, True)
            except OSError as e:
                log.warning("%s: no OFD lock to keep its WAL from other processes (%s)", path, e)
            return key

    def release(self, key: tuple[int, int], close: Callable[[], None]) -> None:
        """Call `close` (the store's connection closing) and give one store's guard back. When it
        was the process's last store of the file, the lock goes first, so SQLite's last-connection
        cleanup (checkpoint, delete the -wal and -shm files) runs as it would without a guard."""
        with self._mutex:
            self._give_back_dropped()
            self._give_back(key, close)

    def drop(self, key: tuple[int, int]) -> None:
        """A store was collected without close() (a finalizer: takes no lock; see the class docstring)."""
        self._dropped.append(key)

    def _give_back(self, key: tuple[int, int], close: Callable[[], None]) -> None:
        fd, stores = self._held[key]
        if stores > 1:
            self._held[key][1] -= 1
            close()
            return
        del self._held[key]
        try:
            _ofd_lock(fd, False)
        except OSError:
            pass  # os.close below drops it anyway
        try:
            close()
        finally:
            os.close(fd)

    def _give_back_dropped(self) -> None:
        while self._dropped:
            self._give_back(self._dropped.pop(), _nothing)


def _ofd_lock(fd: int, locked: bool) -> None:
    """Take or drop the OFD read lock on SQLite's SHARED bytes (nothing where there are no OFD locks)."""
    if _OFD_SETLK is None:
        return
    kind = fcntl.F_RDLCK if locked else fcntl.F_UNLCK
    request = _FLOCK.pack(kind, os.SEEK_SET, _SHARED_FIRST, _SHARED_SIZE, 0)
    fcntl.fcntl(fd, _OFD_SETLK, request + bytes(8))  # padded: the kernel reads a whole struct flock


def _nothing() -> None:
    pass


_GUARDS = _Guards()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_GUARDS.forget_after_fork)
