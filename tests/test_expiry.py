"""Memory expiry (Mem0's expiration_date): an expired fact is never listed, searched, counted or
injected, and the sweep forgets it from every store: facts and history words, both indexes, the
KV blob locally and in the shared tier. SQLite and PostgreSQL, a schema-3 home migrated."""

from __future__ import annotations

import sqlite3
import time
from dataclasses import replace
from datetime import date, datetime, timezone

import pytest
from fastapi.testclient import TestClient

from kvmem.config import Config, KVConfig
from kvmem.errors import InvalidInputError, UnknownFactError
from kvmem.facts.expiry import expires_at_of
from kvmem.facts.pg import PgFactStore
from kvmem.facts.records import SCHEMA_VERSION
from kvmem.facts.scope import Scope
from kvmem.facts.store import FactStore
from kvmem.kv.shared import SharedTier
from kvmem.service import KVMem
from tests.kv.test_blob import make_blob

PAST, FUTURE = "2020-01-01", "2999-12-31"
ALICE = Scope("alice")


def test_expiration_dates_read_as_mem0s():
    day_after = datetime(2025, 7, 1, tzinfo=timezone.utc).timestamp()
    assert expires_at_of("2025-06-30") == expires_at_of(date(2025, 6, 30)) == day_after  # the whole day holds
    assert expires_at_of("2025-06-30T12:00:00") == datetime(2025, 6, 30, 12, tzinfo=timezone.utc).timestamp()
    assert expires_at_of("2025-06-30T14:00:00+02:00") == expires_at_of(datetime(2025, 6, 30, 12))  # naive: UTC
    assert expires_at_of(None) is None and expires_at_of("9999-12-31") > 0
    for bad in ("tomorrow", "", "2025-13-01", 20250630, True, ["2025-06-30"]):
        with pytest.raises(InvalidInputError) as err:
            expires_at_of(bad)
        assert (err.value.param, err.value.code) == ("expiration_date", InvalidInputError.INVALID_VALUE)


@pytest.fixture(params=["sqlite", "pg"])
def store(request, tmp_path):
    s = FactStore(tmp_path / "facts.sqlite") if request.param == "sqlite" else \
        PgFactStore(request.getfixturevalue("pg_url"))
    yield s
    s.close()


def test_the_store_lists_counts_and_sweeps_by_expiry(store):
    now = time.time()
    pairs = store.add_many([{"scope": ALICE, "text": t, "expires_at": e}
                            for t, e in (("gone", now - 5), ("stays", None), ("later", now + 3600))])
    gone, stays, later = (r for r, _ in pairs)
    assert gone.expires_at == now - 5 and gone.expired(now) and not later.expired(now)
    assert [r.id for r in store.list(user_id="alice", live_at=now)] == [stays.id, later.id]
    assert store.count("alice", live_at=now) == 2 and store.count("alice") == 3
    assert store.list(user_id="alice", live_at=now, where=lambda md: True, limit=1) == [store.get(stays.id)]
    assert store.delete_expired(now) == [gone] and store.delete_expired(now) == []
    with pytest.raises(UnknownFactError):
        store.get(gone.id)
    assert [(e.event, e.new_text, e.source) for e in store.history(gone.id)] == [("ADD", None, None),
                                                                                ("DELETE", None, "expiry")]
    assert store.set_expiry(later.id, None).expires_at is None
    assert store.set_expiry(stays.id, now - 1).expired(now)
    assert [r.id for r in store.delete_expired(now + 7200)] == [stays.id]
    for bad in (True, float("nan"), "2025-01-01"):
        with pytest.raises(InvalidInputError, match="expires_at must be None or seconds") as err:
            store.set_expiry(later.id, bad)
        assert err.value.param == "expiration_date"


def test_a_schema_3_sqlite_home_gains_expires_at(tmp_path):
    path = tmp_path / "facts.sqlite"
    s = FactStore(path)
    s.add_many([{"scope": ALICE, "text": f"fact {i}"} for i in range(3)])
    before = [replace(r) for r in s.list(user_id="alice")]
    s.close()
    conn = sqlite3.connect(path)
    conn.execute("DROP INDEX facts_expiry")
    conn.execute("ALTER TABLE facts DROP COLUMN expires_at")
    conn.execute("PRAGMA user_version=3")
    conn.close()
    s = FactStore(path)
    try:
        assert s.list(user_id="alice") == before and all(r.expires_at is None for r in before)
        assert s.set_expiry(before[0].id, 1.0).expires_at == 1.0
        assert [r.id for r in s.delete_expired(time.time())] == [before[0].id]
    finally:
        s.close()
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 5


def test_a_schema_3_postgres_database_gains_expires_at(pg_url):
    import psycopg

    s = PgFactStore(pg_url)
    record, _ = s.add(ALICE, "one")
    s.close()
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("DROP INDEX facts_expiry")
        conn.execute("ALTER TABLE facts DROP COLUMN expires_at")
        conn.execute("UPDATE kvmem_meta SET value = '3' WHERE key = 'schema_version'")
    s = PgFactStore(pg_url)
    try:
        assert s.get(record.id).expires_at is None
        assert s.set_expiry(record.id, 1.0).expired(time.time())
    finally:
        s.close()
    with psycopg.connect(pg_url) as conn:
        assert conn.execute("SELECT value FROM kvmem_meta WHERE key = 'schema_version'").fetchone()[0] == str(SCHEMA_VERSION)


# -- the service, no engine ---------------------------------------------------------------------


@pytest.fixture
def home(tmp_path, model_dir):
    def open_(**kv) -> KVMem:
        return KVMem(Config(home=tmp_path / "home", models_home=model_dir.parent, kv=KVConfig(**kv)),
                     start_engine=False)
    return open_


def _ids(hits) -> list[str]:
    return [h.id for h in hits]


def test_expired_facts_are_not_listed_searched_or_counted(home):
    with home() as mem:
        live = mem.add(facts=["Bees live on the roof.", "Bees make honey in June."], user_id="u", encode="none").ids
        later = mem.add(facts=["Bees swarm in May."], user_id="u", encode="none", expiration_date=FUTURE).ids
        gone = mem.add(facts=["Bees sting the neighbour.", "Bees visit the lavender."], user_id="u",
                       encode="none", expiration_date=PAST).ids
        assert [r.id for r in mem.get_all(user_id="u")] == [*live, *later]
        assert [r.id for r in mem.get_all(user_id="u", filters={"OR": [{"x": "*"}, {"NOT": {"x": "*"}}]})] == \
            [*live, *later]
        for ranking in ("dense", "lexical", "hybrid"):
            hits = _ids(mem.search("Bees sting the neighbour at the lavender", user_id="u", k=3, ranking=ranking))
            assert sorted(hits) == sorted([*live, *later]), ranking  # k live ones, though the expired rank first
        assert mem.get(gone[0]).expired(time.time())  # still stored until the sweep
        mem.update(gone[0], "Bees sting the neighbour.", expiration_date=None)  # revived: never expires
        assert gone[0] in [r.id for r in mem.get_all(user_id="u")]
        mem.update(live[0], "Bees live on the roof.", metadata={"where": "roof"})  # expiry kept when left out
        assert mem.get(live[0]).expires_at is None and mem.get(later[0]).expires_at is not None
        mem.update(later[0], "Bees swarm in May.", expiration_date=date(2020, 5, 1))
        assert later[0] not in _ids(mem.search("swarm", user_id="u", k=5, ranking="lexical"))
        with pytest.raises(InvalidInputError, match="expiration_date must be an ISO date") as err:
            mem.add(facts=["Never stored."], user_id="u", encode="none", expiration_date="next week")
        assert err.value.param == "expiration_date"
        assert "Never stored." not in [r.text for r in mem.facts.list(user_id="u")]


def test_the_sweep_forgets_expired_facts_in_every_store(home, redis_url):
    with home(shared_url=redis_url) as mem:
        keep = mem.add(facts=["The spare key is under the mat."], user_id="u", encode="none").ids[0]
        gone = mem.add(facts=["The door code is 4512 until Friday."], user_id="u", encode="none",
                       expiration_date=PAST).ids[0]
        for fact_id in (keep, gone):
            mem.kv.put(make_blob(fact_id, fp=mem.model.fingerprint))
        tier = SharedTier(redis_url, mem.model.fingerprint)  # another process's view of the shared tier
        assert mem.kv.path(gone).is_file() and tier.stamp(gone) is not None
        assert gone in mem.retrieval.lexical.scores("u", "door code")
        assert mem.sweep_expired() == 1 and mem.sweep_expired() == 0
        with pytest.raises(UnknownFactError):
            mem.get(gone)
        assert [e.event for e in mem.history(gone)] == ["ADD", "DELETE"] and mem.history(gone)[0].new_text is None
        assert gone not in mem.retrieval.lexical.scores("u", "door code")
        vector = mem.embedder.embed(["door code"])[0]
        assert _ids(mem.retrieval.dense.search("u", vector, 10)) == [keep]
        assert not mem.kv.path(gone).exists() and tier.stamp(gone) is None and not mem.kv.exists(gone)
        assert mem.kv.exists(keep) and tier.stamp(keep) is not None and mem.get(keep).expires_at is None
        tier.close()


def test_an_expiry_is_an_instant_a_datetime_can_hold():
    """Issue 53: an instant in the year 0 or 10000 was stored, and every view of the fact a 500."""
    for bad in ("0001-01-01T00:00:00+01:00", "9999-12-31T23:59:59-23:59"):
        with pytest.raises(InvalidInputError) as err:
            expires_at_of(bad)
        assert err.value.param == "expiration_date"
    last = expires_at_of("9999-12-31")  # the whole last day holds, to its last second
    assert datetime.fromtimestamp(last, timezone.utc) == datetime(9999, 12, 31, 23, 59, 59, tzinfo=timezone.utc)


def test_every_add_sweeps_first(home):
    with home() as mem:
        gone = mem.add(facts=["A fact for one day."], user_id="u", encode="none", expiration_date=PAST).ids[0]
        mem.add(facts=["A fact for ever."], user_id="u", encode="none")
        with pytest.raises(UnknownFactError):
            mem.get(gone)
        again = mem.add(facts=["A fact for one day."], user_id="u", encode="none", expiration_date=FUTURE)
        assert again.created == 1 and again.ids[0] != gone  # a new fact, not the expired duplicate


def test_the_http_api_takes_expiration_date(tmp_path, model_dir):
    from kvmem.server.app import create_app
    from kvmem.server.settings import ServerSettings

    config = Config(home=tmp_path / "home", models_home=model_dir.parent)
    app = create_app(ServerSettings(api_keys={"k1": "t1"}), config,
                     mem_factory=lambda: KVMem(config, start_engine=False))
    with TestClient(app, headers={"Authorization": "Bearer k1"}) as c:
        assert c.app.state.runtime.loaded.wait(60) and c.app.state.runtime.mem is not None
        c.post("/v1/memories", json={"user_id": "ana", "facts": ["Ana's library card."], "expiration_date": FUTURE})
        add = {"user_id": "ana", "facts": ["Ana's parking permit."], "expiration_date": PAST}  # last: adds sweep
        fact_id = c.post("/v1/memories", json=add).json()["results"][0]["id"]
        listed = c.get("/v1/memories", params={"user_id": "ana"}).json()
        assert [m["memory"] for m in listed["results"]] == ["Ana's library card."] and listed["total"] == 1
        assert listed["results"][0]["expiration_date"] == "3000-01-01T00:00:00+00:00"  # the instant it expires
        found = c.post("/v1/memories/search", json={"user_id": "ana", "query": "parking permit"}).json()["results"]
        assert [m["memory"] for m in found] == ["Ana's library card."]
        r = c.put(f"/v1/memories/{fact_id}", json={"text": "Ana's parking permit.", "expiration_date": None})
        assert r.status_code == 200, r.text
        assert c.get("/v1/memories", params={"user_id": "ana"}).json()["total"] == 2
        r = c.post("/v1/memories", json={**add, "expiration_date": "soon"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "expiration_date", r.text


# -- the engine: never injected -------------------------------------------------------------------


def test_an_expired_fact_is_not_injected(mem, tmp_path):
    """On the session's engine, a KVMem with its own facts (blobs in the engine's folder, as in
    tests/test_tiers.py): the same question picks the fact while it lives, and not once expired."""
    config = replace(mem.config, home=tmp_path / "home", kv_root=mem.config.kv_dir)
    with KVMem(config, engine=mem.engine, embedder=mem.embedder, background=False) as m:
        ids = m.add(facts=["Alice keeps bees on the roof of her flat.", "Alice's brother Tom plays the cello."],
                    user_id="alice", encode="sync", expiration_date=FUTURE).ids
        assert all(m.get(i).kv_status == "encoded" for i in ids)
        before = m.chat("Where does Alice keep bees?", user_id="alice", k=2, mode="kv", max_tokens=4)
        assert ids[0] in before.fact_ids and before.injected_tokens > 0
        m.update(ids[0], "Alice keeps bees on the roof of her flat.", expiration_date=PAST)
        after = m.chat("Where does Alice keep bees?", user_id="alice", k=2, mode="kv", max_tokens=4)
        assert after.fact_ids == (ids[1],)
        named = m.chat("Where does Alice keep bees?", user_id="alice", fact_ids=list(ids), mode="kv", max_tokens=2)
        assert named.fact_ids == (ids[1],)  # named or retrieved, an expired fact is not injected
        assert m.sweep_expired() == 1 and not m.kv.exists(ids[0]) and m.kv.exists(ids[1])
