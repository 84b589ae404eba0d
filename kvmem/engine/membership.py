"""Which replicas are live, kept in PostgreSQL: replicas register themselves, gateways read the set.

A replica (`kvmem replica --database-url ...`, replica_lease.py) registers its URL, model
fingerprint and capacity in `kvmem_replicas` and renews a lease every third of its length; it
leaves when stopped, and a replica that dies without leaving is dropped when its lease runs out.
Draining (`kvmem replica --drain URL`) keeps the row but takes the replica out of the live set:
gateways send it nothing new while what it already has runs to its end.

Gateways watch the set (`Watcher`): LISTEN on the table's channel for changes, and read it again
every `refresh_s` seconds, because a lease that runs out is no write and notifies nobody. Lease
times are PostgreSQL's own clock (now()), so hosts whose clocks disagree still agree on a lease.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import psycopg

from kvmem.errors import InvalidInputError, KvmemError
from kvmem.facts import is_postgres
from kvmem.facts.pg import LOCK_KEY

log = logging.getLogger(__name__)

CHANNEL = "kvmem_replicas"
LEASE_S = 10.0  # a replica that stops renewing is dropped this long after its last renewal
REFRESH_S = 2.0  # gateways re-read the set at least this often (expiries notify nobody)
_CONNECT_TIMEOUT_S = 5

SCHEMA = f"""
CREATE TABLE IF NOT EXISTS {CHANNEL} (
    url TEXT PRIMARY KEY,
    fingerprint TEXT NOT NULL,
    capacity INTEGER NOT NULL DEFAULT 1 CHECK (capacity > 0),
    draining BOOLEAN NOT NULL DEFAULT FALSE,
    registered_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    lease_until TIMESTAMPTZ NOT NULL
)"""


@dataclass(frozen=True)
class Member:
    url: str
    fingerprint: str
    capacity: int
    draining: bool
    lease_left_s: float  # negative: expired (not yet swept)

    @property
    def live(self) -> bool:
        return not self.draining and self.lease_left_s > 0


class Registry:
    """The membership table, one short autocommit connection per call (calls are rare: a renewal
    every few seconds per replica, a read every few seconds per gateway)."""

    def __init__(self, database_url: str, create: bool = True) -> None:
        """`create=False` for a caller that only changes rows already there (`kvmem replica
        --drain`): it takes no lock, so a writer holding the facts' lock cannot hold it up."""
        if not is_postgres(database_url):
            raise InvalidInputError("replica membership needs a PostgreSQL URL (postgresql://...)",
                                    param="database_url")
        self.url = database_url
        if not create:
            return
        with self._conn() as conn, conn.transaction():
            # CREATE TABLE IF NOT EXISTS races itself (two replicas starting at once: one fails on
            # pg_type's unique index), so creators take the facts writers' advisory lock first.
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (LOCK_KEY,))
            conn.execute(SCHEMA)

    def _conn(self) -> psycopg.Connection:
        try:
            return psycopg.connect(self.url, autocommit=True, connect_timeout=_CONNECT_TIMEOUT_S)
        except psycopg.OperationalError as e:
            raise KvmemError(f"replica membership: cannot reach PostgreSQL: {e}") from e

    def register(self, url: str, fingerprint: str, capacity: int = 1, lease_s: float = LEASE_S) -> None:
        """Join (or rejoin, no longer draining) with a fresh lease."""
        with self._conn() as conn:
            conn.execute(f"""INSERT INTO {CHANNEL} (url, fingerprint, capacity, lease_until)
                             VALUES (%s, %s, %s, now() + make_interval(secs => %s))
                             ON CONFLICT (url) DO UPDATE SET fingerprint = EXCLUDED.fingerprint,
                               capacity = EXCLUDED.capacity, draining = FALSE, lease_until = EXCLUDED.lease_until,
                               registered_at = now()""", (url, fingerprint, capacity, lease_s))
            conn.execute(f"NOTIFY {CHANNEL}")

    def renew(self, url: str, lease_s: float = LEASE_S) -> bool:
        """Extend the lease; False when the row is gone (swept or left): register again."""
        with self._conn() as conn:
            n = conn.execute(f"UPDATE {CHANNEL} SET lease_until = now() + make_interval(secs => %s) WHERE url = %s",
                             (lease_s, url)).rowcount
        return n == 1

    def drain(self, url: str) -> bool:
        """Take `url` out of the live set (its row and lease stay); False if it is not registered."""
        with self._conn() as conn:
            try:
                n = conn.execute(f"UPDATE {CHANNEL} SET draining = TRUE WHERE url = %s", (url,)).rowcount
            except psycopg.errors.UndefinedTable:
                return False  # no replica ever registered in this database
            conn.execute(f"NOTIFY {CHANNEL}")
        return n == 1

    def leave(self, url: str) -> None:
        with self._conn() as conn:
            conn.execute(f"DELETE FROM {CHANNEL} WHERE url = %s", (url,))
            conn.execute(f"NOTIFY {CHANNEL}")

    def members(self) -> list[Member]:
        """Every registered replica, expired leases included (a gateway may still be told of them)."""
        with self._conn() as conn:
            rows = conn.execute(f"""SELECT url, fingerprint, capacity, draining,
                                      EXTRACT(EPOCH FROM lease_until - now())::float8
                                    FROM {CHANNEL} ORDER BY url""").fetchall()
        return [Member(*row) for row in rows]

    def live(self, fingerprint: str) -> list[str]:
        """URLs of the replicas serving `fingerprint` that hold a lease and are not draining."""
        return [m.url for m in self.members() if m.live and m.fingerprint == fingerprint]


class Watcher:
    """A gateway's view of the live set: `on_change(urls)` runs (on this thread) whenever the
    live URLs for `fingerprint` change, and once at start."""

    def __init__(self, registry: Registry, fingerprint: str, on_change: Callable[[list[str]], None],
                 refresh_s: float = REFRESH_S) -> None:
        self._registry, self._fingerprint, self._on_change = registry, fingerprint, on_change
        self._refresh_s = refresh_s
        self._stop = threading.Event()
        self.urls: list[str] = registry.live(fingerprint)
        on_change(list(self.urls))
        self._thread = threading.Thread(target=self._run, name="kvmem-replica-watcher", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        conn = None
        while not self._stop.is_set():
            try:
                if conn is None:
                    conn = self._registry._conn()
                    conn.execute(f"LISTEN {CHANNEL}")
                for _ in conn.notifies(timeout=self._refresh_s, stop_after=1):
                    pass  # woken by a change, or the timeout: read the set either way
                self._read()
            except (psycopg.Error, KvmemError) as e:
                log.warning("replica membership: %s; retrying in %.0f s", e, self._refresh_s)
                if conn is not None:
                    conn.close()
                conn = None
                self._stop.wait(self._refresh_s)
        if conn is not None:
            conn.close()

    def _read(self) -> None:
        urls = self._registry.live(self._fingerprint)
        if urls != self.urls:
            log.info("live replicas: %s (were %s)", urls, self.urls)
            self.urls = urls
            self._on_change(list(urls))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self._refresh_s + 5)
