"""Encode leases: one encoder at a time per (fact, model fingerprint), across every process.

Gateways sharing one PostgreSQL each run a background encoder over the facts whose KV is
pending, and a sync write encodes its facts at once: without a lease, two of them send the same
fact to the replicas. An encoder takes a fact's lease before sending it, and gives it back once
the outcome is recorded (the blob stamped, or the attempt counted as failed).

PostgreSQL (PgLeases): a row per lease in `kvmem_encode_leases`, with an expiry on the server's
clock, rather than a session advisory lock, because
* an advisory lock lives on one connection: a restart of PostgreSQL (or a reconnect) drops it
  while its holder is still encoding, so a second gateway encodes the fact again; and a holder
  whose host vanished without closing its socket keeps it until TCP keepalive notices (hours,
  by default). A row survives both, and frees itself at `expires_at`;
* gateways' clocks are never compared: every expiry is `clock_timestamp()` of the server.
The cost: a SIGKILLed holder's facts wait up to `ttl_s` before another encoder takes them
(served by text prefill meanwhile). A live holder renews its leases every ttl_s/3, so an encode
may take longer than ttl_s.

A lease is a promise not to start, not a proof that the work is still to do: a lease given back
a moment ago may be an encode that already stamped the blob. Whoever takes one re-reads the fact
(the encoder does) before encoding it.

SQLite is served by one process, so its leases are a set in that process (LocalLeases): they
keep its sync writes and its background loop from encoding one fact twice, and die with it.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import uuid
from collections.abc import Iterable

from kvmem.facts.records import MAX_LIMIT

log = logging.getLogger(__name__)

TTL_S = 30.0  # a dead holder's facts wait this long; a live one renews every TTL_S / 3
TABLE = "kvmem_encode_leases"
_CREATE = (f"CREATE TABLE IF NOT EXISTS {TABLE} (fact_id TEXT NOT NULL, fingerprint TEXT NOT NULL,"
           " holder TEXT NOT NULL, expires_at TIMESTAMPTZ NOT NULL, PRIMARY KEY (fact_id, fingerprint))")
_EXPIRY = "clock_timestamp() + ? * interval '1 second'"
# An expired lease is taken over; one this process holds on the server but lost track of (its
# insert committed, then the connection dropped before the answer) is taken back.
_TAKE = (" ON CONFLICT (fact_id, fingerprint)"
         " DO UPDATE SET holder = excluded.holder, expires_at = excluded.expires_at"
         f" WHERE {TABLE}.expires_at <= clock_timestamp() OR {TABLE}.holder = excluded.holder RETURNING fact_id")
_INSERT = f"INSERT INTO {TABLE} (fact_id, fingerprint, holder, expires_at)"
_ACQUIRE = f"{_INSERT} SELECT unnest(?::text[]), ?, ?, {_EXPIRY}" + _TAKE
# SKIP LOCKED: two gateways claiming at once take different facts, not the same ones twice. A
# live lease of this holder's that it does not know of (lost in an outage) is claimable again.
# -> (due rows locked, ids leased). Fewer leased than locked means a race was lost: the statement's
# snapshot predates a lease committed since (a claim that had these rows locked, or an acquire),
# so the insert met it; a new statement's snapshot sees it and picks other facts.
_CLAIM = (f"WITH due AS (SELECT id FROM facts f WHERE kv_status IN ('pending', 'failed') AND kv_attempts < ?"
          f" AND id <> ALL(?::text[]) AND NOT EXISTS (SELECT 1 FROM {TABLE} l WHERE l.fact_id = f.id"
          f" AND l.fingerprint = ? AND l.expires_at > clock_timestamp() AND l.holder <> ?)"
          f" ORDER BY kv_attempts, created_at, rowid LIMIT ? FOR UPDATE SKIP LOCKED),"
          f" taken AS ({_INSERT} SELECT id, ?, ?, {_EXPIRY} FROM due{_TAKE})"
          " SELECT (SELECT count(*) FROM due), ARRAY(SELECT fact_id FROM taken)")
_CLAIM_TRIES = 4  # each lost race means another claimer just leased facts; a few tries find the rest
_RENEW = f"UPDATE {TABLE} SET expires_at = {_EXPIRY} WHERE fingerprint = ? AND holder = ? AND fact_id = ANY(?::text[])"
_RELEASE = f"DELETE FROM {TABLE} WHERE fingerprint = ? AND holder = ? AND fact_id = ANY(?::text[])"
_SWEEP = f"DELETE FROM {TABLE} WHERE expires_at < clock_timestamp() - ? * interval '1 second'"


def open_leases(facts, fingerprint: str, ttl_s: float = TTL_S) -> LocalLeases:
    """The leases for `facts`' encoders: rows in its database when it is PostgreSQL, else in-process."""
    # A PgFactStore exists only if its module was imported: no psycopg import for SQLite users.
    pg = sys.modules.get("kvmem.facts.pg")
    if pg is not None and isinstance(facts, pg.PgFactStore):
        return PgLeases(facts, fingerprint, ttl_s)
    return LocalLeases(facts)


class LocalLeases:
    """Leases within one process (SQLite: its only writer). Thread-safe; the encoder's threads share it."""

    def __init__(self, facts) -> None:
        self.facts = facts
        self._held: set[str] = set()
        self._lock = threading.Lock()

    def acquire(self, fact_ids: Iterable[str]) -> set[str]:
        """Lease those of `fact_ids` nobody holds; -> the ids leased now (to give back with release)."""
        with self._lock:
            mine = set(fact_ids) - self._held
            mine &= self._take(mine)
            self._held |= mine
        return mine

    def claim(self, limit: int, max_attempts: int | None) -> list[str]:
        """Lease up to `limit` facts due for encoding that nobody holds: the first ones in `pending`'s
        order (returned in no particular order)."""
        with self._lock:
            mine = [fact_id for fact_id in self._pick(limit, max_attempts) if fact_id not in self._held]
            self._held.update(mine)
        return mine

    def release(self, fact_ids: Iterable[str]) -> None:
        with self._lock:
            mine = set(fact_ids) & self._held
            self._held -= mine
        if mine:
            self._give_back(mine)

    def close(self) -> None:
        """Nothing outlives the process: its leases die with it."""

    # What a shared database does instead (PgLeases), called with the lock held.
    def _take(self, fact_ids: set[str]) -> set[str]:
        return fact_ids

    def _pick(self, limit: int, max_attempts: int | None) -> list[str]:
        due = self.facts.pending(min(limit + len(self._held), MAX_LIMIT), max_attempts=max_attempts)
        return [r.id for r in due if r.id not in self._held][:limit]

    def _give_back(self, fact_ids: set[str]) -> None:
        pass


class PgLeases(LocalLeases):
    """Rows in the store's PostgreSQL database (see the module docstring), on a connection of
    their own, behind this process's set: the encoder's threads never lease one fact twice
    either. The connection opens on first use; a renewer thread runs from the first lease on."""

    def __init__(self, facts, fingerprint: str, ttl_s: float = TTL_S) -> None:
        super().__init__(facts)
        self.url, self.fingerprint, self.ttl_s = facts.url, fingerprint, float(ttl_s)
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._conn = None
        self._conn_lock = threading.Lock()
        self._renewer: threading.Thread | None = None
        self._stop = threading.Event()

    def _take(self, fact_ids: set[str]) -> set[str]:
        if not fact_ids:
            return set()
        rows = self._run(_ACQUIRE, (sorted(fact_ids), self.fingerprint, self.holder, self.ttl_s))
        return self._renewing({row[0] for row in rows})

    def _pick(self, limit: int, max_attempts: int | None) -> list[str]:
        attempts = max_attempts if max_attempts is not None else 2**62
        taken: set[str] = set()
        for _ in range(_CLAIM_TRIES):
            (row,) = self._run(_CLAIM, (attempts, sorted(self._held | taken), self.fingerprint, self.holder,
                                        limit - len(taken), self.fingerprint, self.holder, self.ttl_s))
            locked, leased = row[0], row[1]
            taken.update(leased)
            if len(leased) == locked or len(taken) >= limit:
                break
        return sorted(self._renewing(taken))

    def _give_back(self, fact_ids: set[str]) -> None:
        try:
            self._run(_RELEASE, (self.fingerprint, self.holder, sorted(fact_ids)), rows=False)
        except Exception as e:  # noqa: BLE001 - unreleased, the lease expires in ttl_s
            log.warning("encode leases: giving back %d leases failed (%s); they expire in %.0f s",
                        len(fact_ids), e, self.ttl_s)

    def close(self) -> None:
        self._stop.set()
        if self._renewer is not None and self._renewer is not threading.current_thread():
            self._renewer.join(timeout=10)
        self._renewer = None
        with self._conn_lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
        self._stop.clear()  # leased again later, it reconnects and renews again

    def _renewing(self, taken: set[str]) -> set[str]:
        if taken and (self._renewer is None or not self._renewer.is_alive()):
            self._renewer = threading.Thread(target=self._renew_loop, name="kvmem-encode-leases", daemon=True)
            self._renewer.start()
        return taken

    def _renew_loop(self) -> None:
        """The renewer thread: extends this process's leases, and sweeps long-expired ones (a dead
        holder's, whose facts were deleted since: nobody else would)."""
        while not self._stop.wait(self.ttl_s / 3):
            with self._lock:
                held = sorted(self._held)
            try:
                if held:
                    self._run(_RENEW, (self.ttl_s, self.fingerprint, self.holder, held), rows=False)
                self._run(_SWEEP, (self.ttl_s,), rows=False)
            except Exception as e:  # noqa: BLE001 - try again next tick; meanwhile leases may lapse
                log.warning("encode leases: renewing failed (%s); retrying in %.0f s", e, self.ttl_s / 3)

    def _run(self, statement: str, params: tuple, rows: bool = True) -> list:
        with self._conn_lock:
            if self._conn is None:
                self._conn = self._connect()
            cursor = self._conn.execute(statement, params)
        return cursor.fetchall() if rows else []

    def _connect(self):
        from kvmem.facts.pg import LOCK_KEY, PgDialect

        conn = PgDialect(self.url).connect()  # the facts schema in place; reconnects by itself
        try:
            if conn.execute("SELECT to_regclass(?)", (TABLE,)).fetchone()[0] is None:
                # Under the writers' lock, so two gateways starting at once do not race CREATE TABLE.
                conn.execute("BEGIN")
                conn.execute("SELECT pg_advisory_xact_lock(?)", (LOCK_KEY,))
                conn.execute(_CREATE)
                conn.execute("COMMIT")
        except BaseException:
            conn.close()
            raise
        return conn
