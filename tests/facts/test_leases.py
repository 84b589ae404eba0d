"""Encode leases (kvmem/facts/leases.py) on a real PostgreSQL, and in one process for SQLite."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import psycopg
import pytest

from kvmem.facts import FactStore, Scope
from kvmem.facts.leases import TABLE, LocalLeases, PgLeases, open_leases
from kvmem.facts.pg import PgFactStore

FP = "fingerprint-a"


@pytest.fixture
def pg_store(pg_url):
    store = PgFactStore(pg_url)
    yield store
    store.close()


def _facts(store, n: int, user: str = "u") -> list[str]:
    return [r.id for r, _ in store.add_many([{"scope": Scope(user), "text": f"fact {i}"} for i in range(n)])]


def _leases(store, ttl_s: float = 30.0) -> PgLeases:
    leases = open_leases(store, FP, ttl_s)
    assert isinstance(leases, PgLeases)
    return leases


def test_a_lease_is_held_by_one_process_until_given_back(pg_store):
    a, b = _leases(pg_store), _leases(PgFactStore(pg_store.url))
    (fact,) = _facts(pg_store, 1)
    assert a.acquire([fact]) == {fact}
    assert b.acquire([fact]) == set() and a.acquire([fact]) == set()  # nor twice in one process
    other_model = open_leases(pg_store, "fingerprint-b")
    assert other_model.acquire([fact]) == {fact}  # a lease is per (fact, model fingerprint)
    a.release([fact])
    assert b.acquire([fact]) == {fact}
    for leases in (a, b, other_model):
        leases.close()


def test_concurrent_claims_split_the_due_facts(pg_store):
    """Four claimers claim at once, round after round: none waits on another's locked rows
    (SKIP LOCKED), each due fact goes to exactly one of them. The rounds are held in step by a
    barrier, so whether each claimer gets work does not depend on how the threads are scheduled."""
    ids = _facts(pg_store, 40)
    pg_store.set_kv_status(ids[0], "encoded")
    for _ in range(2):
        pg_store.set_kv_status(ids[1], "failed")  # two attempts: no longer due under max_attempts=2
    claimers = [_leases(PgFactStore(pg_store.url)) for _ in range(4)]
    rounds: list[list[list[str]]] = [[[] for _ in claimers] for _ in range(2)]
    step = threading.Barrier(len(claimers))

    def claim(i: int) -> None:
        for claimed in rounds:
            step.wait(timeout=60)
            claimed[i] = claimers[i].claim(5, max_attempts=2)

    try:
        threads = [threading.Thread(target=claim, args=(i,)) for i in range(len(claimers))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        rest = []
        while batch := claimers[0].claim(5, max_attempts=2):
            rest += batch
        # Round 1: 38 due, 20 asked for; SKIP LOCKED hides at most 15 from any claimer: each gets 5.
        assert [len(batch) for batch in rounds[0]] == [5] * len(claimers)
        every = [fact for claimed in rounds for batch in claimed for fact in batch] + rest
        assert sorted(every) == sorted(ids[2:])  # each due fact claimed once, by one claimer
    finally:
        for leases in claimers:
            leases.close()


def test_a_claim_whose_facts_were_leased_after_its_snapshot_claims_others(pg_store, pg_url):
    """The race behind a claimer coming back empty while facts were due: its statement's snapshot
    does not see a lease committed while it ran (here a sync write's acquire, held open in a
    transaction), so it picks that lease's facts and its insert meets the lease. It claims again
    on a fresh snapshot and gets the next due facts."""
    ids = _facts(pg_store, 10)
    claimer, other = _leases(PgFactStore(pg_url)), _leases(pg_store)
    assert other.acquire([ids[-1]]) == {ids[-1]}  # (the table exists from here on)
    other.release([ids[-1]])
    first = [r.id for r in pg_store.pending(5, max_attempts=2)]  # what a claim picks first
    claimed: list[str] = []
    with psycopg.connect(pg_url, autocommit=True) as writer:
        writer.execute("BEGIN")
        writer.execute(f"INSERT INTO {TABLE} SELECT unnest(%s::text[]), %s, 'writer',"
                       " clock_timestamp() + interval '1 minute'", (first, FP))
        thread = threading.Thread(target=lambda: claimed.extend(claimer.claim(5, max_attempts=2)))
        thread.start()
        deadline = time.monotonic() + 30
        # Watched from another connection: inside the writer's transaction, pg_stat_activity is a snapshot.
        with psycopg.connect(pg_url, autocommit=True) as watcher:
            while not watcher.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                                      " AND datname = current_database()").fetchone()[0]:
                assert thread.is_alive() and time.monotonic() < deadline, "the claim never waited on the lease"
                time.sleep(0.02)
        writer.execute("COMMIT")
        thread.join(timeout=30)
    try:
        assert sorted(claimed) == sorted(set(ids) - set(first))
    finally:
        claimer.close()
        other.close()


def test_a_lease_outlives_its_holders_connection(pg_store, pg_url):
    """Why a row and not an advisory lock: PostgreSQL dropping the holder's connection (as a
    restart does) leaves the lease held; the holder gives it back once reconnected."""
    a, b = _leases(pg_store), _leases(PgFactStore(pg_url))
    (fact,) = _facts(pg_store, 1)
    assert a.acquire([fact]) == {fact}
    with psycopg.connect(pg_url, autocommit=True) as admin:
        dropped = admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                                " WHERE datname = current_database() AND pid <> pg_backend_pid()").fetchall()
    assert dropped
    assert b.acquire([fact]) == set()
    a.release([fact])
    assert b.acquire([fact]) == {fact}
    a.close()
    b.close()


def test_a_lease_its_holder_lost_track_of_is_claimed_by_that_holder_only(pg_store, pg_url):
    """A lease row its holder does not know of (its insert committed, then the answer was lost;
    or its give-back failed in an outage): other holders wait for its expiry, its own holder
    claims the fact again at once."""
    a, b = _leases(pg_store), _leases(PgFactStore(pg_url))
    first, second = _facts(pg_store, 2)
    assert b.acquire([second]) == {second}  # (the table exists from here on)
    b.release([second])
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(f"INSERT INTO {TABLE} VALUES (%s, %s, %s, clock_timestamp() + interval '1 minute')",
                     (first, FP, a.holder))
    assert b.claim(5, max_attempts=3) == [second] and b.acquire([first]) == set()
    assert a.claim(5, max_attempts=3) == [first]
    a.close()
    b.close()


_HOLDER = """
import sys, time
from kvmem.facts.leases import PgLeases
from kvmem.facts.pg import PgFactStore
leases = PgLeases(PgFactStore(sys.argv[1]), sys.argv[2], float(sys.argv[3]))
assert leases.acquire([sys.argv[4]]) == {sys.argv[4]}
print("held", flush=True)
time.sleep(600)
"""


def test_a_sigkilled_holders_lease_expires_and_a_live_ones_is_renewed(pg_store, pg_url):
    ttl = 2.0
    (fact,) = _facts(pg_store, 1)
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, pg_url, FP, str(ttl), fact], stdout=subprocess.PIPE,
                              text=True)
    other = _leases(PgFactStore(pg_url), ttl)
    try:
        assert holder.stdout.readline().strip() == "held"
        time.sleep(2 * ttl)  # alive: its renewer keeps the lease past several ttls
        assert other.acquire([fact]) == set()
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        with psycopg.connect(pg_url, autocommit=True) as conn:
            killed_at, expires_at = conn.execute(f"SELECT clock_timestamp(), expires_at FROM {TABLE}").fetchone()
        assert 0 < (expires_at - killed_at).total_seconds() <= ttl  # renewed within its last ttl
        while not other.acquire([fact]):  # nobody gives it back: it expires
            time.sleep(0.05)
        with psycopg.connect(pg_url, autocommit=True) as conn:
            taken_at, holder_now = conn.execute(f"SELECT clock_timestamp(), holder FROM {TABLE}").fetchone()
        assert taken_at >= expires_at and holder_now == other.holder
    finally:
        holder.kill()
        holder.wait()
        other.close()


def test_sqlite_leases_are_in_process(tmp_path):
    store = FactStore(tmp_path / "facts.sqlite")
    ids = _facts(store, 5)
    leases = open_leases(store, FP)
    assert type(leases) is LocalLeases
    assert leases.acquire(ids[:2]) == set(ids[:2]) and leases.acquire(ids[:3]) == {ids[2]}
    assert leases.claim(10, max_attempts=3) == ids[3:]  # the due facts nobody holds, in pending's order
    assert leases.claim(10, max_attempts=3) == []
    leases.release(ids)
    assert leases.claim(2, max_attempts=3) == ids[:2]
    store.close()
