"""engine/membership.py and replica_lease.py against a real PostgreSQL: leases, draining, expiry,
and a gateway's watcher hearing each change."""

from __future__ import annotations

import time

import psycopg
import pytest

from kvmem.engine.membership import Registry, Watcher
from kvmem.engine.replica_lease import Lease
from kvmem.errors import InvalidInputError
from tests.helpers import until


def _until(check, timeout: float = 10.0):
    until(check, timeout)


def test_a_registered_replica_is_live_until_it_drains_or_leaves(pg_url):
    registry = Registry(pg_url)
    registry.register("http://a:8000", "fp1", capacity=4)
    registry.register("http://b:8000", "fp1")
    registry.register("http://c:8000", "fp2")  # other weights: never routed to for fp1
    assert registry.live("fp1") == ["http://a:8000", "http://b:8000"]
    assert registry.drain("http://a:8000") and registry.live("fp1") == ["http://b:8000"]
    (a,) = [m for m in registry.members() if m.url == "http://a:8000"]
    assert a.draining and a.capacity == 4 and a.lease_left_s > 0
    registry.register("http://a:8000", "fp1")  # a restarted replica registers again: live again
    registry.leave("http://b:8000")
    assert registry.live("fp1") == ["http://a:8000"] and not registry.drain("http://b:8000")


def test_a_lease_not_renewed_runs_out_and_a_renewed_one_does_not(pg_url):
    registry = Registry(pg_url)
    registry.register("http://dead:8000", "fp", lease_s=0.5)
    lease = Lease(registry, "http://alive:8000", "fp", lease_s=0.6)  # renewed every 0.2 s
    try:
        time.sleep(1.5)
        assert registry.live("fp") == ["http://alive:8000"]
        assert not registry.renew("http://gone:8000")
    finally:
        lease.stop()
    assert registry.live("fp") == []  # stopping leaves at once


def test_a_watcher_hears_joins_drains_and_expiries(pg_url):
    registry = Registry(pg_url)
    seen: list[list[str]] = []
    watcher = Watcher(registry, "fp", seen.append, refresh_s=0.5)
    try:
        assert seen == [[]]
        registry.register("http://a:8000", "fp", lease_s=60)
        _until(lambda: seen[-1] == ["http://a:8000"], timeout=5)
        registry.register("http://b:8000", "fp", lease_s=1.0)
        _until(lambda: seen[-1] == ["http://a:8000", "http://b:8000"], timeout=5)
        registry.drain("http://a:8000")
        _until(lambda: seen[-1] == ["http://b:8000"], timeout=5)
        _until(lambda: seen[-1] == [], timeout=5)  # b's lease ran out: no write, the periodic read sees it
    finally:
        watcher.close()


def test_membership_needs_postgresql():
    with pytest.raises(InvalidInputError) as e:
        Registry("sqlite:///tmp/x.db")
    assert e.value.param == "database_url"


def test_replicas_starting_at_once_on_a_fresh_database_all_create_the_registry(pg_url):
    # CREATE TABLE IF NOT EXISTS is not safe against itself: two replicas of a clean-clone
    # topology test started together and one died on pg_type's unique index.
    import threading

    for _ in range(3):
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute("DROP TABLE IF EXISTS kvmem_replicas")
        start, errors = threading.Barrier(6), []

        def open_registry():
            start.wait()
            try:
                Registry(pg_url)
            except Exception as e:  # noqa: BLE001 - the test reports whatever a starter hit
                errors.append(e)

        threads = [threading.Thread(target=open_registry) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []


def test_a_drain_waits_on_no_writer_and_creates_nothing(pg_url):
    """`kvmem replica --drain` timed out in a clean clone while a chat ran: opening the registry
    took the facts writers' lock (for its CREATE TABLE). A drain only updates a row."""
    from kvmem.facts.pg import LOCK_KEY

    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS kvmem_replicas")
    assert not Registry(pg_url, create=False).drain("http://a:8000")  # no table: not registered
    with psycopg.connect(pg_url, autocommit=True) as conn:
        assert conn.execute("SELECT to_regclass('kvmem_replicas')").fetchone()[0] is None
    Registry(pg_url).register("http://a:8000", "fp")
    import threading

    drained: list[bool] = []
    with psycopg.connect(pg_url) as writer:  # a writer holding the lock in an open transaction
        writer.execute("SELECT pg_advisory_xact_lock(%s)", (LOCK_KEY,))
        drain = threading.Thread(target=lambda: drained.append(Registry(pg_url, create=False).drain("http://a:8000")),
                                 daemon=True)
        drain.start()
        drain.join(timeout=10)
        writer.rollback()  # lets a drain that did wait on the lock go on
        assert drained == [True]  # done while the writer still held the lock
    drain.join(timeout=10)
    assert Registry(pg_url).live("fp") == []
