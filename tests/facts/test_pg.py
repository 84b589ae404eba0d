"""PgFactStore beyond FactStore's behaviour (which test_store.py checks on both backends): several
processes on one database, the change feed, lost connections. All on a real PostgreSQL server."""

import multiprocessing
import queue
import threading
import time

import psycopg
import pytest

from kvmem.errors import InvalidInputError, KvmemError
from kvmem.facts import FactStore, open_fact_store
from kvmem.facts import store as store_module
from kvmem.facts.pg import LOCK_KEY, PgFactStore, _translate
from kvmem.facts.scope import Scope

ALICE = Scope("alice")


@pytest.fixture
def stores(pg_url):
    """Opens PgFactStores on the test's database (stand-ins for gateway processes); closes them after."""
    opened = []

    def open_one():
        opened.append(PgFactStore(pg_url))
        return opened[-1]

    yield open_one
    for s in opened:
        s.close()


def admin(url):
    return psycopg.connect(url, autocommit=True)


def backends(url, where="TRUE"):
    """Pids of this database's other connections (the stores' and their listeners')."""
    with admin(url) as conn:
        sql = ("SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
               f" AND pid <> pg_backend_pid() AND {where}")
        return [pid for (pid,) in conn.execute(sql).fetchall()]


def terminate(url, pids):
    assert pids
    with admin(url) as conn:
        for pid in pids:
            conn.execute("SELECT pg_terminate_backend(%s)", (pid,))


def wait_until(check, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def changes_until(feed, last_op, timeout=20.0):
    """What a subscriber received, up to and including the first change with op `last_op`."""
    got = []
    while not got or got[-1]["op"] != last_op:
        got.append(feed.get(timeout=timeout))
    return got


# -- several writers -------------------------------------------------------------------------


def test_two_instances_adding_the_same_text_make_one_fact(stores):
    a, b = stores(), stores()
    barrier = threading.Barrier(10)
    results, errors = [], []

    def worker(s):
        try:
            barrier.wait()
            results.append(s.add(ALICE, "the same fact"))
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in (a, b) * 5]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    assert sum(created for _, created in results) == 1
    assert len({r.id for r, _ in results}) == 1
    assert a.count() == b.count() == 1
    assert [e.event for e in b.history(results[0][0].id)] == ["ADD"]


def _add_in_another_process(url, barrier, results):
    s = PgFactStore(url)
    try:
        barrier.wait()
        record, created = s.add(ALICE, "  the same   fact ")
        results.put((record.id, created))
    finally:
        s.close()


def test_two_processes_adding_the_same_text_make_one_fact(pg_url):
    spawn = multiprocessing.get_context("spawn")  # a clean interpreter, as a second gateway is
    barrier, results = spawn.Barrier(3, timeout=120), spawn.Queue()
    procs = [spawn.Process(target=_add_in_another_process, args=(pg_url, barrier, results)) for _ in range(3)]
    for p in procs:
        p.start()
    got = [results.get(timeout=180) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert sorted(created for _, created in got) == [False, False, True]
    assert len({fact_id for fact_id, _ in got}) == 1
    with PgFactStore(pg_url) as s:
        assert [r.text for r in s.list()] == ["the same   fact"]  # trimmed; inner spaces only matter to dedupe


def test_a_second_instance_sees_every_write_of_the_first(stores):
    a, b = stores(), stores()
    r, _ = a.add(ALICE, "one", embedding=[1.0, 2.0])
    a.save_usage({r.id: 3})
    assert b.get(r.id) == r
    assert b.usage() == {r.id: 3}
    b.delete(r.id)
    assert a.count() == 0 and [e.event for e in a.history(r.id)] == ["ADD", "DELETE"]


# -- change feed -----------------------------------------------------------------------------


def test_the_change_feed_delivers_commits_in_order_and_nothing_rolled_back(stores):
    a, b = stores(), stores()
    to_b, to_a = queue.Queue(), queue.Queue()
    b.subscribe(to_b.put)
    a.subscribe(to_a.put)  # a writer hears its own writes too

    one, _ = a.add(ALICE, "one")
    a.add(ALICE, " one ")  # a duplicate changes nothing
    a.update(one.id, "one, updated")
    a.set_kv_status(one.id, "encoded")  # KV bookkeeping is not news
    a.save_usage({one.id: 2})
    a.set_embedding(one.id, [1.0, 0.0])
    with pytest.raises(InvalidInputError, match="already in use"):  # rolled back: its add is never told
        a.add_many([{"scope": ALICE, "text": "never"}, {"scope": ALICE, "text": "x", "fact_id": one.id}])
    two, _ = a.add(Scope("bob", "agent"), "two")
    (three, _), (four, _) = a.add_many([{"scope": Scope("bob"), "text": t} for t in ("three", "four")])
    a.delete(one.id)
    a.delete_scope("bob")
    a.reset()

    expected = [
        {"op": "add", "id": one.id, "user_id": "alice"},
        {"op": "update", "id": one.id, "user_id": "alice"},
        {"op": "update", "id": one.id, "user_id": "alice"},
        {"op": "add", "id": two.id, "user_id": "bob"},
        {"op": "add", "id": three.id, "user_id": "bob"},
        {"op": "add", "id": four.id, "user_id": "bob"},
        {"op": "delete", "id": one.id, "user_id": "alice"},
        {"op": "delete", "id": two.id, "user_id": "bob"},
        {"op": "delete", "id": three.id, "user_id": "bob"},
        {"op": "delete", "id": four.id, "user_id": "bob"},
        {"op": "reset"},
    ]
    assert changes_until(to_b, "reset") == expected
    assert changes_until(to_a, "reset") == expected


def test_the_feed_follows_commit_order_of_two_writers(stores):
    a, b, listener = stores(), stores(), stores()
    feed = queue.Queue()
    listener.subscribe(feed.put)
    ids = []
    for i in range(10):
        writer = (a, b)[i % 2]
        ids.append(writer.add(ALICE, f"fact {i}")[0].id)
    a.reset()
    assert [c.get("id") for c in changes_until(feed, "reset")] == [*ids, None]


def test_the_feed_resyncs_after_losing_its_connection(stores, pg_url):
    a, b = stores(), stores()
    feed = queue.Queue()
    b.subscribe(feed.put)
    first, _ = a.add(ALICE, "before")
    assert feed.get(timeout=20) == {"op": "add", "id": first.id, "user_id": "alice"}

    terminate(pg_url, backends(pg_url, "query = 'LISTEN kvmem_facts'"))
    assert feed.get(timeout=30) == {"op": "resync"}  # what happened meanwhile may have been missed
    second, _ = a.add(ALICE, "after")
    assert feed.get(timeout=20) == {"op": "add", "id": second.id, "user_id": "alice"}


def test_a_change_too_long_to_notify_asks_for_a_resync(stores):
    a = stores()
    feed = queue.Queue()
    a.subscribe(feed.put)
    a.add(Scope("u" * 9000), "a user id longer than a notification may be")
    one, _ = a.add(ALICE, "one")
    got = [feed.get(timeout=20), feed.get(timeout=20)]
    assert got == [{"op": "resync"}, {"op": "add", "id": one.id, "user_id": "alice"}]


def test_a_failing_callback_does_not_end_the_feed(stores):
    a = stores()
    feed = queue.Queue()

    def callback(change):
        feed.put(change)
        raise RuntimeError("subscriber bug")

    a.subscribe(callback)
    a.add(ALICE, "one")
    a.add(ALICE, "two")
    assert [c["op"] for c in (feed.get(timeout=20), feed.get(timeout=20))] == ["add", "add"]


def test_stopping_a_subscription_and_closing_the_store_end_the_listeners(stores):
    a, b = stores(), stores()
    stopped, kept = queue.Queue(), queue.Queue()
    stop = b.subscribe(stopped.put)
    b.subscribe(kept.put)
    stop()
    stop()  # idempotent
    a.add(ALICE, "one")
    assert kept.get(timeout=20)["op"] == "add"
    time.sleep(0.5)
    assert stopped.empty()
    b.close()

    def listeners():
        return [t for t in threading.enumerate() if t.name == "kvmem-facts-listener"]

    wait_until(lambda: not listeners())


# -- lost connections ------------------------------------------------------------------------


def test_the_store_reconnects_after_its_connection_is_killed(stores, pg_url):
    s = stores()
    record, _ = s.add(ALICE, "one")
    terminate(pg_url, backends(pg_url))
    assert s.count() == 1  # a read on a dead connection is sent again on a fresh one
    terminate(pg_url, backends(pg_url))
    assert s.add(ALICE, "two")[1] is True  # so is the BEGIN of a write: nothing of it had run
    assert [r.text for r in s.list()] == ["one", "two"]


def test_a_write_that_loses_its_connection_raises_and_applies_nothing(stores, pg_url):
    s = stores()
    s.add(ALICE, "kept")
    errors = []
    with psycopg.connect(pg_url) as blocker:  # holds the writers' lock, so the add waits mid-transaction
        blocker.execute("SELECT pg_advisory_xact_lock(%s)", (LOCK_KEY,))

        def add():
            try:
                s.add_many([{"scope": ALICE, "text": "lost"}])
            except Exception as e:  # checked below
                errors.append(e)

        writer = threading.Thread(target=add)
        writer.start()
        waiting = "wait_event_type = 'Lock' AND wait_event = 'advisory'"
        wait_until(lambda: backends(pg_url, waiting))
        terminate(pg_url, backends(pg_url, waiting))
        writer.join(20)
        blocker.rollback()
    assert len(errors) == 1 and isinstance(errors[0], KvmemError)
    assert "lost the connection" in str(errors[0])
    assert [r.text for r in s.list()] == ["kept"]
    assert s.add(ALICE, "after")[1] is True


def test_an_unreachable_server_or_a_bad_url_is_refused_without_showing_the_password():
    from kvmem.bench.servers import free_port

    with pytest.raises(KvmemError, match="cannot connect to PostgreSQL at postgresql://u:\\*\\*\\*@127.0.0.1") as e:
        PgFactStore(f"postgresql://u:secret@127.0.0.1:{free_port()}/db?connect_timeout=2")
    assert "secret" not in str(e.value)
    with pytest.raises(InvalidInputError, match="bad database url postgresql://u:\\*\\*\\*@") as e:
        PgFactStore("postgresql://u:secret@127.0.0.1:5432/db?no_such_option=1")
    assert "secret" not in str(e.value)


# -- schema and values -----------------------------------------------------------------------


def test_a_newer_schema_is_refused(stores, pg_url):
    stores().close()
    with admin(pg_url) as conn:
        conn.execute("UPDATE kvmem_meta SET value = %s WHERE key = 'schema_version'",
                     (str(store_module.SCHEMA_VERSION + 1),))
    with pytest.raises(KvmemError, match="newer kvmem"):
        PgFactStore(pg_url)


def test_a_schema_2_database_gains_origin(stores, pg_url):
    s = stores()
    record, _ = s.add(ALICE, "one")
    with admin(pg_url) as conn:
        conn.execute("ALTER TABLE facts DROP COLUMN origin")
        conn.execute("UPDATE kvmem_meta SET value = '2' WHERE key = 'schema_version'")
    s = stores()
    assert s.get(record.id).origin == ""
    other, _ = s.add(ALICE, "two", origin="Alice: two, I said")
    assert stores().get(other.id).origin == "Alice: two, I said"
    with admin(pg_url) as conn:
        version = conn.execute("SELECT value FROM kvmem_meta WHERE key = 'schema_version'").fetchone()[0]
    assert version == str(store_module.SCHEMA_VERSION)


def test_a_schema_4_database_gains_history_source(stores, pg_url):
    s = stores()
    record, _ = s.add(ALICE, "one")
    with admin(pg_url) as conn:
        conn.execute("ALTER TABLE history DROP COLUMN source")
        conn.execute("UPDATE kvmem_meta SET value = '4' WHERE key = 'schema_version'")
    s = stores()
    assert [(e.event, e.source) for e in s.history(record.id)] == [("ADD", None)]
    s.set_expiry(record.id, 1.0)
    s.delete_expired(2.0)
    assert [(e.event, e.source) for e in stores().history(record.id)] == [("ADD", None), ("DELETE", "expiry")]


def test_times_are_double_precision(stores, pg_url):
    s = stores()
    record, _ = s.add(ALICE, "one")
    assert stores().get(record.id).created_at == record.created_at  # float4 would round it
    with admin(pg_url) as conn:
        types = dict(conn.execute("SELECT column_name, data_type FROM information_schema.columns"
                                  " WHERE table_name IN ('facts', 'history') AND column_name IN"
                                  " ('created_at', 'updated_at', 'at', 'embedding')").fetchall())
    assert types == {"created_at": "double precision", "updated_at": "double precision",
                     "at": "double precision", "embedding": "bytea"}


def test_nul_characters_are_refused_and_nothing_is_written(stores):
    s = stores()
    with pytest.raises(InvalidInputError, match="NUL"):
        s.add(ALICE, "text", context="a\x00b")
    with pytest.raises(InvalidInputError, match="NUL"):
        s.add(ALICE, "text", origin="a\x00b")
    assert s.count() == 0
    with pytest.raises(KeyError):
        s.get("f-\x00")


def test_placeholders_are_translated_outside_string_literals():
    assert _translate("SELECT ? WHERE a = :name AND b = '?:x%' AND c::text = '%'") == (
        "SELECT %s WHERE a = %(name)s AND b = '?:x%%' AND c::text = '%%'"
    )


# -- choosing a store ------------------------------------------------------------------------


def test_open_fact_store_chooses_the_backend(pg_url, tmp_path):
    with open_fact_store(None, tmp_path / "facts.sqlite") as s:
        assert type(s) is FactStore and s.path == tmp_path / "facts.sqlite"
    for url in (pg_url, pg_url.replace("postgresql://", "postgres://", 1)):
        with open_fact_store(url, tmp_path / "unused.sqlite") as s:
            assert isinstance(s, PgFactStore)
            s.add(ALICE, "x")
    assert not (tmp_path / "unused.sqlite").exists()


@pytest.mark.parametrize("url", ["mysql://u:secret@host/db", "facts.sqlite", "", 42])
def test_open_fact_store_refuses_other_urls(url, tmp_path):
    with pytest.raises(InvalidInputError, match="^database url must start with postgresql:// or postgres://") as e:
        open_fact_store(url, tmp_path / "facts.sqlite")
    assert "secret" not in str(e.value)
