import threading
import time

import numpy as np
import pytest

from kvmem.errors import InvalidInputError, KvmemError, UnknownFactError
from kvmem.facts import store as store_module
from kvmem.facts.scope import Scope
from kvmem.facts.store import FactRecord, FactStore, HistoryEvent, content_hash

ALICE = Scope("alice")


@pytest.fixture
def path(tmp_path):
    return tmp_path / "db" / "facts.sqlite"


@pytest.fixture(params=["sqlite", "postgres"])
def open_store(request, path):
    """Opens the test's store: the SQLite file at `path`, or a fresh PostgreSQL database; each
    call opens another handle on the same data (a reopen); all are closed after the test."""
    if request.param == "sqlite":
        def opener():
            return FactStore(path)
    else:
        from kvmem.facts.pg import PgFactStore

        url = request.getfixturevalue("pg_url")

        def opener():
            return PgFactStore(url)
    opened = []

    def open_one():
        opened.append(opener())
        return opened[-1]

    yield open_one
    for s in opened:
        s.close()


@pytest.fixture
def store(open_store):
    return open_store()


def raw_bytes(path):
    """Everything SQLite keeps on disk for this database: the main file and its WAL."""
    data = path.read_bytes()
    wal = path.with_name(path.name + "-wal")
    return data + (wal.read_bytes() if wal.exists() else b"")


def kept(store, path, token: bytes) -> bool:
    """Whether `token` is still stored: for SQLite anywhere in its files (secure_delete zeroes
    deleted rows); for PostgreSQL in any live row (dead tuples wait for VACUUM: see pg.py)."""
    if type(store) is FactStore:
        return token in raw_bytes(path)
    import psycopg

    with psycopg.connect(store.url) as conn:
        rows = conn.execute("SELECT f::text FROM facts f UNION ALL SELECT h::text FROM history h"
                            " UNION ALL SELECT k::text FROM kv_usage k").fetchall()
    return token.decode() in "\n".join(row[0] for row in rows)


# -- Scope -----------------------------------------------------------------------------------


def test_scope_key_is_stable_and_cannot_be_forged():
    assert Scope("u", "a", "r").key == Scope("u", "a", "r").key
    assert Scope("u").key != Scope("u", "a").key
    # A '|' or quote inside one id must not make it collide with another triple.
    assert Scope("u|a:x").key != Scope("u", "x").key
    assert Scope('u","a').key != Scope("u", "a").key
    assert Scope("u", None, "r").key != Scope("u", "r").key
    for scope in (Scope("u"), Scope("u", "a"), Scope('u","a', None, "r|x")):
        assert Scope.from_key(scope.key) == scope


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"user_id": ""}, "user_id"),
        ({"user_id": "   "}, "user_id"),
        ({"user_id": None}, "user_id"),
        ({"user_id": 7}, "user_id"),
        ({"user_id": "u", "agent_id": ""}, "agent_id"),
        ({"user_id": "u", "agent_id": 3}, "agent_id"),
        ({"user_id": "u", "run_id": " "}, "run_id"),
    ],
)
def test_scope_rejects_bad_fields_naming_them(kwargs, field):
    with pytest.raises(InvalidInputError, match=f"^{field} must be"):
        Scope(**kwargs)


# -- add / get -------------------------------------------------------------------------------


def test_round_trip_of_every_field(store):
    vec = np.array([0.5, -1.25, 3.0], dtype=np.float64)
    before = time.time()
    record, created = store.add(
        Scope("bob", "agent-1", "run-9"),
        "  Bob is allergic to peanuts.  ",
        metadata={"topic": "health", "tags": ["food", "allergy"], "nested": {"level": 2, "ok": True}},
        source="messages",
        context="user: what should I cook?\nassistant: any allergies?",
        event_time="2024-05-01T10:30:00+00:00",
        position=4,
        conversation_id="conv-1",
        embedding=vec,
        fact_id="fact-bob-1",
    )
    assert created is True
    got = store.get("fact-bob-1")
    assert got == record
    assert got.id == "fact-bob-1"
    assert got.scope == Scope("bob", "agent-1", "run-9")
    assert got.scope_key == Scope("bob", "agent-1", "run-9").key
    assert (got.user_id, got.agent_id, got.run_id) == ("bob", "agent-1", "run-9")
    assert got.text == "Bob is allergic to peanuts."  # outer whitespace trimmed
    assert got.metadata == {"topic": "health", "tags": ["food", "allergy"], "nested": {"level": 2, "ok": True}}
    assert before <= got.created_at == got.updated_at <= time.time()
    assert got.source == "messages"
    assert got.event_time == "2024-05-01T10:30:00+00:00"
    assert got.context == "user: what should I cook?\nassistant: any allergies?"
    assert got.position == 4
    assert got.conversation_id == "conv-1"
    assert got.content_hash == content_hash("Bob is allergic to peanuts.")
    assert (got.kv_status, got.kv_attempts) == ("pending", 0)
    assert got.embedding.dtype == np.float32
    np.testing.assert_array_equal(got.embedding, vec.astype(np.float32))
    assert got.embedding_dim == 3
    assert store.history("fact-bob-1") == [HistoryEvent("fact-bob-1", "ADD", None, got.text, got.created_at, "bob")]


def test_defaults_and_generated_id(store):
    record, created = store.add(ALICE, "Alice likes tea.")
    assert created
    assert record.id.startswith("f-") and len(record.id) == 34
    assert record.metadata == {} and record.context == "" and record.source == "fact"
    assert record.event_time is None and record.position is None and record.conversation_id is None
    assert record.embedding is None and record.embedding_dim is None
    assert store.get(record.id) == record


def test_event_time_accepts_datetime(store):
    from datetime import datetime, timezone

    when = datetime(2024, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
    record, _ = store.add(ALICE, "x", event_time=when)
    assert record.event_time == when.isoformat()


def test_dedupe_within_a_scope(store):
    first, created = store.add(ALICE, "Alice likes tea.", metadata={"v": 1})
    again, created_again = store.add(ALICE, "  Alice   likes\ttea. ", metadata={"v": 2})
    assert created and not created_again
    assert again == first and again.metadata == {"v": 1}  # nothing written
    assert store.count() == 1
    assert [e.event for e in store.history(first.id)] == ["ADD"]
    # Case is meaningful, and another scope is another namespace.
    assert store.add(ALICE, "alice likes tea.")[1] is True
    other, created_other = store.add(Scope("alice", "agent"), "Alice likes tea.")
    assert created_other and other.id != first.id
    assert store.count() == 3


def test_add_many_is_one_transaction(store):
    results = store.add_many(
        [
            {"scope": ALICE, "text": "one", "metadata": {"i": 1}},
            {"scope": ALICE, "text": "two", "position": 2},
            {"scope": ALICE, "text": "one"},  # duplicate of the first item
        ]
    )
    assert [c for _, c in results] == [True, True, False]
    assert results[2][0] == results[0][0]
    assert results[1][0].position == 2
    assert [r.text for r in store.list()] == ["one", "two"]
    # A bad item anywhere means nothing of the batch is written.
    with pytest.raises(InvalidInputError, match="fact text must be a non-empty string"):
        store.add_many([{"scope": ALICE, "text": "three"}, {"scope": ALICE, "text": ""}])
    with pytest.raises(InvalidInputError, match="unknown keys"):
        store.add_many([{"scope": ALICE, "text": "three", "colour": "red"}])
    assert store.count() == 2


def test_add_many_rolls_back_on_a_failure_midway(store):
    store.add(ALICE, "taken", fact_id="fixed-id")
    with pytest.raises(InvalidInputError, match="already in use"):
        store.add_many([{"scope": ALICE, "text": "new one"}, {"scope": ALICE, "text": "other", "fact_id": "fixed-id"}])
    assert [r.text for r in store.list()] == ["taken"]


# -- persistence -----------------------------------------------------------------------------


def test_everything_survives_reopen(open_store):
    s = open_store()
    a, _ = s.add(ALICE, "Alice likes tea.", metadata={"k": "v"}, embedding=[1.0, 2.0], context="ctx")
    b, _ = s.add(Scope("bob", "agent"), "Bob likes coffee.", source="messages", position=1)
    c, _ = s.add(ALICE, "Alice lives in Paris.")
    s.update(b.id, "Bob likes espresso.")
    s.set_kv_status(a.id, "encoded")
    s.delete(c.id)
    listed, histories, vectors = s.list(), {f: s.history(f) for f in (a.id, b.id, c.id)}, list(s.embeddings())
    s.close()

    reopened = open_store()  # for PostgreSQL: what another process sees
    try:
        assert reopened.list() == listed
        assert [r.text for r in listed] == ["Alice likes tea.", "Bob likes espresso."]
        assert {f: reopened.history(f) for f in (a.id, b.id, c.id)} == histories
        again = list(reopened.embeddings())
        assert [(i, k, m) for i, k, _, m in again] == [(i, k, m) for i, k, _, m in vectors]
        assert [(i, k, m) for i, k, _, m in again] == [(a.id, ALICE.key, {"k": "v"})]
        np.testing.assert_array_equal(again[0][2], np.array([1.0, 2.0], dtype=np.float32))
        assert reopened.get(a.id).kv_status == "encoded"
        with pytest.raises(UnknownFactError):
            reopened.get(c.id)
    finally:
        reopened.close()


def test_closed_store_refuses_use(open_store):
    s = open_store()
    s.close()
    s.close()  # idempotent
    for call in (s.count, s.usage, lambda: s.add(ALICE, "x"), lambda: s.subscribe(print)):
        with pytest.raises(KvmemError, match="closed"):
            call()


# -- list ------------------------------------------------------------------------------------


def test_list_isolates_scopes(store):
    store.add(Scope("alice"), "a0")
    store.add(Scope("alice", "agent-1"), "a1")
    store.add(Scope("alice", "agent-1", "run-1"), "a1r1")
    store.add(Scope("alice", "agent-2", "run-1"), "a2r1")
    store.add(Scope("bob"), "b0")
    store.add(Scope("bob", "agent-1"), "b1")

    def texts(**kw):
        return [r.text for r in store.list(**kw)]

    assert texts(user_id="alice") == ["a0", "a1", "a1r1", "a2r1"]
    assert texts(user_id="bob") == ["b0", "b1"]
    assert texts(user_id="alice", agent_id="agent-1") == ["a1", "a1r1"]
    assert texts(user_id="alice", run_id="run-1") == ["a1r1", "a2r1"]
    assert texts(user_id="alice", agent_id="agent-1", run_id="run-1") == ["a1r1"]
    assert texts(agent_id="agent-1") == ["a1", "a1r1", "b1"]
    assert texts(user_id="carol") == []
    assert len(texts()) == 6
    assert store.count(user_id="alice") == 4
    assert store.count("alice", "agent-1") == 2
    assert store.count(user_id="bob", run_id="run-1") == 0


def test_paging_without_where(store):
    ids = [store.add(ALICE, f"fact {i}")[0].id for i in range(25)]
    pages = [store.list(user_id="alice", limit=10, offset=o) for o in (0, 10, 20)]
    assert [len(p) for p in pages] == [10, 10, 5]
    assert [r.id for p in pages for r in p] == ids
    assert store.list(limit=10, offset=25) == []
    assert [r.text for r in store.list(limit=3, offset=5)] == ["fact 5", "fact 6", "fact 7"]


@pytest.mark.parametrize("chunk", [3, 1000])
def test_paging_with_where_filters_before_paging(store, monkeypatch, chunk):
    monkeypatch.setattr(store_module, "_CHUNK", chunk)  # small chunks exercise the keyset paging
    for i in range(20):
        store.add(ALICE, f"fact {i}", metadata={"n": i})
    store.add(Scope("bob"), "bob fact", metadata={"n": 2})

    def even(meta):
        return meta["n"] % 2 == 0

    expected = [f"fact {i}" for i in range(0, 20, 2)]
    pages = [[r.text for r in store.list(user_id="alice", where=even, limit=3, offset=o)] for o in range(0, 12, 3)]
    assert pages == [expected[0:3], expected[3:6], expected[6:9], expected[9:10]]
    assert [r.text for r in store.list(user_id="alice", where=even, limit=100)] == expected
    assert store.list(user_id="alice", where=even, offset=10) == []
    assert [r.text for r in store.list(where=lambda m: m["n"] == 2)] == ["fact 2", "bob fact"]


def test_where_may_call_back_into_the_store(store):
    a, _ = store.add(ALICE, "a", metadata={"n": 1})
    store.add(ALICE, "b", metadata={"n": 2})
    assert [r.text for r in store.list(where=lambda m: store.count() == 2 and m["n"] == 2)] == ["b"]
    assert store.get(a.id).text == "a"


# -- update ----------------------------------------------------------------------------------


def test_update_records_history_and_resets_kv(store):
    record, _ = store.add(ALICE, "Alice likes tea.", metadata={"k": 1}, embedding=[1.0, 0.0])
    store.set_kv_status(record.id, "failed")
    store.set_kv_status(record.id, "encoded")
    updated = store.update(record.id, "Alice likes green tea.")
    assert updated.text == "Alice likes green tea."
    assert updated.content_hash == content_hash("Alice likes green tea.") != record.content_hash
    assert (updated.kv_status, updated.kv_attempts) == ("pending", 0)
    assert updated.embedding is None  # made from the old words
    assert updated.metadata == {"k": 1}  # None keeps metadata
    assert updated.created_at == record.created_at < updated.updated_at
    assert store.get(record.id) == updated
    events = store.history(record.id)
    assert [(e.event, e.old_text, e.new_text) for e in events] == [
        ("ADD", None, "Alice likes tea."),
        ("UPDATE", "Alice likes tea.", "Alice likes green tea."),
    ]
    # The old text no longer blocks a new fact; the new one does.
    assert store.add(ALICE, "Alice likes tea.")[1] is True
    assert store.add(ALICE, "Alice likes green tea.")[1] is False


def test_update_metadata_and_embedding_only_keeps_kv(store):
    record, _ = store.add(ALICE, "Alice likes tea.", metadata={"k": 1})
    store.set_kv_status(record.id, "encoded")
    updated = store.update(record.id, "Alice likes tea.", metadata={"k": 2}, embedding=[0.25, 0.5])
    assert updated.metadata == {"k": 2}
    assert updated.kv_status == "encoded"
    np.testing.assert_array_equal(updated.embedding, [0.25, 0.5])
    assert [e.event for e in store.history(record.id)] == ["ADD", "UPDATE"]
    # An update that changes nothing writes nothing.
    assert store.update(record.id, "Alice likes tea.") == updated
    assert len(store.history(record.id)) == 2


def test_update_refuses_a_duplicate_in_the_same_scope(store):
    a, _ = store.add(ALICE, "one")
    b, _ = store.add(ALICE, "two")
    store.add(Scope("bob"), "three")
    with pytest.raises(InvalidInputError, match=f"duplicates fact '{a.id}' in the same scope"):
        store.update(b.id, " one ")
    assert store.get(b.id).text == "two"
    assert store.update(b.id, "three").text == "three"  # another scope's fact is no clash


# -- delete ----------------------------------------------------------------------------------

SECRET = "zebra-octopus-7781 is my bank PIN"


@pytest.mark.parametrize("size", ["short", "overflow"])
def test_delete_forgets_the_text_on_disk(store, path, size):
    secret = SECRET if size == "short" else SECRET + " " + "padding-words " * 800  # > one page: overflow pages
    for i in range(50):
        store.add(ALICE, f"neighbour fact {i}", context=f"neighbour context {i}")
    record, _ = store.add(
        ALICE, secret, context="ctx: zebra-octopus-7781 context", metadata={"note": "zebra-octopus-7781 meta"}
    )
    store.update(record.id, secret + " (updated)")  # history now holds the text twice more
    for i in range(50, 60):
        store.add(ALICE, f"neighbour fact {i}")
    token = b"zebra-octopus-7781"
    assert kept(store, path, token)  # the check below can fail: the text is stored before delete

    deleted = store.delete(record.id)

    assert deleted.text == secret + " (updated)"
    assert not kept(store, path, token)
    with pytest.raises(UnknownFactError):
        store.get(record.id)
    assert [(e.event, e.old_text, e.new_text) for e in store.history(record.id)] == [
        ("ADD", None, None),
        ("UPDATE", None, None),
        ("DELETE", None, None),
    ]
    assert store.count() == 60
    assert store.get(store.list(limit=1)[0].id).text == "neighbour fact 0"
    with pytest.raises(UnknownFactError):
        store.delete(record.id)


def test_delete_forgetting_survives_reopen(open_store, path):
    s = open_store()
    record, _ = s.add(ALICE, SECRET)
    s.add(ALICE, "kept")
    s.delete(record.id)
    s.close()
    s = open_store()
    assert not kept(s, path, b"zebra-octopus-7781")
    assert [r.text for r in s.list()] == ["kept"]
    assert [e.event for e in s.history(record.id)] == ["ADD", "DELETE"]


def test_delete_scope(store, path):
    store.add(Scope("alice"), "alice plain zebra-octopus-7781")
    a1, _ = store.add(Scope("alice", "agent-1"), "alice agent-1 zebra-octopus-7781")
    a1r, _ = store.add(Scope("alice", "agent-1", "run-1"), "alice agent-1 run-1")
    store.add(Scope("alice", "agent-2"), "alice agent-2")
    bob, _ = store.add(Scope("bob", "agent-1"), "bob agent-1")

    assert store.delete_scope(Scope("alice", "agent-1")) == [a1.id, a1r.id]
    assert [r.text for r in store.list(user_id="alice")] == ["alice plain zebra-octopus-7781", "alice agent-2"]
    assert [e.event for e in store.history(a1.id)] == ["ADD", "DELETE"]
    assert store.history(a1.id)[0].new_text is None

    assert len(store.delete_scope("alice")) == 2
    assert store.count(user_id="alice") == 0
    assert store.list() == [store.get(bob.id)]
    assert not kept(store, path, b"zebra-octopus-7781")
    assert store.delete_scope("nobody") == []


def test_delete_scope_needs_a_user(store):
    with pytest.raises(InvalidInputError, match="^user_id must be a non-empty string, got None"):
        store.delete_scope(None)
    with pytest.raises(InvalidInputError, match="^user_id must be a non-empty string"):
        store.delete_scope("  ", agent_id="a")
    with pytest.raises(InvalidInputError, match="not both"):
        store.delete_scope(ALICE, agent_id="a")


def test_reset_drops_facts_and_history(store, path):
    record, _ = store.add(ALICE, SECRET)
    store.reset()
    assert store.count() == 0
    with pytest.raises(UnknownFactError):
        store.history(record.id)
    assert not kept(store, path, b"zebra-octopus-7781")
    assert store.add(ALICE, SECRET)[1] is True


# -- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["", "   ", "\n\t", None, 42, b"bytes", ["x"]])
def test_add_rejects_bad_text(store, text):
    with pytest.raises(InvalidInputError, match="^fact text must be a non-empty string$"):
        store.add(ALICE, text)
    assert store.count() == 0


@pytest.mark.parametrize("text", ["", "  ", None])
def test_update_rejects_bad_text(store, text):
    record, _ = store.add(ALICE, "fine")
    with pytest.raises(InvalidInputError, match="^fact text must be a non-empty string$"):
        store.update(record.id, text)
    assert store.get(record.id).text == "fine"


@pytest.mark.parametrize(
    "metadata",
    [
        ["not", "a", "dict"],
        "string",
        {1: "int key"},
        {"nested": {2: "int key"}},
        {"f": float("nan")},
        {"obj": object()},
        {"t": (1, 2)},
        {"s": {1, 2}},
    ],
)
def test_add_rejects_bad_metadata(store, metadata):
    with pytest.raises(InvalidInputError, match="^metadata must be a JSON-serializable dict with str keys"):
        store.add(ALICE, "text", metadata=metadata)
    assert store.count() == 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"source": "chat"}, "^source must be one of"),
        ({"context": None}, "^context must be a string"),
        ({"position": -1}, "^position must be None or an int >= 0"),
        ({"position": True}, "^position must be None or an int >= 0"),
        ({"event_time": "yesterday"}, "^event_time must be None, a datetime or an ISO 8601 string"),
        ({"conversation_id": ""}, "^conversation_id must be None or a non-empty string"),
        ({"embedding": [[1.0]]}, "^embedding must be a non-empty 1-D array"),
        ({"embedding": []}, "^embedding must be a non-empty 1-D array"),
        ({"embedding": ["a"]}, "^embedding must be a non-empty 1-D array"),
        ({"embedding": [1.0, float("inf")]}, "^embedding must hold finite"),
        ({"fact_id": "../etc"}, "^fact id '../etc' must be 1-128 of"),
    ],
)
def test_add_rejects_bad_keywords(store, kwargs, message):
    with pytest.raises(InvalidInputError, match=message):
        store.add(ALICE, "text", **kwargs)
    assert store.count() == 0


def test_add_rejects_a_non_scope(store):
    with pytest.raises(InvalidInputError, match="^scope must be a Scope, got str"):
        store.add("alice", "text")


def test_unknown_ids(store):
    for call in (
        lambda: store.get("f-missing"),
        lambda: store.update("f-missing", "text"),
        lambda: store.delete("f-missing"),
        lambda: store.history("f-missing"),
        lambda: store.set_kv_status("f-missing", "encoded"),
        lambda: store.set_embedding("f-missing", [1.0]),
        lambda: store.get(123),
    ):
        with pytest.raises(UnknownFactError, match="^unknown fact id"):
            call()


def test_fact_ids_are_never_reused(store):
    record, _ = store.add(ALICE, "one", fact_id="mine")
    with pytest.raises(InvalidInputError, match="^fact id 'mine' is already in use"):
        store.add(ALICE, "two", fact_id="mine")
    store.delete(record.id)
    with pytest.raises(InvalidInputError, match="^fact id 'mine' is already in use"):
        store.add(ALICE, "three", fact_id="mine")  # its history is still there


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"limit": 0}, r"^limit must be an int in 1\.\.10000, got 0"),
        ({"limit": 10_001}, r"^limit must be an int in 1\.\.10000"),
        ({"limit": "10"}, r"^limit must be an int in 1\.\.10000"),
        ({"limit": True}, r"^limit must be an int in 1\.\.10000"),
        ({"offset": -1}, r"^offset must be an int in 0\.\.9223372036854775807, got -1"),
        ({"offset": 1.5}, r"^offset must be an int in 0\.\."),
        ({"user_id": ""}, r"^user_id must be None or a non-empty string"),
        ({"agent_id": 5}, r"^agent_id must be None or a non-empty string"),
    ],
)
def test_list_rejects_bad_arguments(store, kwargs, message):
    with pytest.raises(InvalidInputError, match=message):
        store.list(**kwargs)


def test_list_accepts_limit_bounds(store):
    store.add(ALICE, "one")
    assert len(store.list(limit=1)) == len(store.list(limit=10_000)) == 1


# -- kv status and embeddings -----------------------------------------------------------------


def test_pending_and_kv_status(store):
    a, _ = store.add(ALICE, "a")
    b, _ = store.add(ALICE, "b")
    c, _ = store.add(ALICE, "c")
    assert [r.id for r in store.pending()] == [a.id, b.id, c.id]
    assert store.set_kv_status(a.id, "failed") is True
    store.set_kv_status(a.id, "failed")
    store.set_kv_status(b.id, "encoded")
    got = store.get(a.id)
    assert (got.kv_status, got.kv_attempts) == ("failed", 2)
    assert store.get(b.id).kv_attempts == 0
    assert [r.id for r in store.pending()] == [c.id, a.id]  # least-tried first, encoded excluded
    assert [r.id for r in store.pending(limit=1)] == [c.id]
    assert [r.id for r in store.pending(max_attempts=2)] == [c.id]
    with pytest.raises(InvalidInputError, match="^kv status must be one of"):
        store.set_kv_status(a.id, "done")
    with pytest.raises(InvalidInputError, match="^limit must be"):
        store.pending(limit=0)


def test_kv_status_guard_against_a_racing_update(store):
    record, _ = store.add(ALICE, "old words")
    store.update(record.id, "new words")
    assert store.set_kv_status(record.id, "encoded", if_text="old words") is False
    assert store.get(record.id).kv_status == "pending"
    assert store.set_kv_status(record.id, "encoded", if_text="new words") is True
    assert store.get(record.id).kv_status == "encoded"


def test_embeddings_and_set_embedding(store, monkeypatch):
    monkeypatch.setattr(store_module, "_CHUNK", 2)
    ids = [store.add(Scope(f"u{i}"), f"fact {i}", metadata={"i": i})[0].id for i in range(5)]
    assert list(store.embeddings()) == []
    for i in (0, 2, 3, 4):
        assert store.set_embedding(ids[i], np.full(4, i, dtype=np.float64)) is True
    got = list(store.embeddings())
    assert [(f, k, m) for f, k, _, m in got] == [(ids[i], Scope(f"u{i}").key, {"i": i}) for i in (0, 2, 3, 4)]
    for (_, _, vec, _), i in zip(got, (0, 2, 3, 4)):
        assert vec.dtype == np.float32
        np.testing.assert_array_equal(vec, np.full(4, i, dtype=np.float32))
    assert store.get(ids[2]).embedding_dim == 4
    assert store.set_embedding(ids[2], [9.0], if_text="something else") is False
    assert store.set_embedding(ids[2], None) is True
    assert store.get(ids[2]).embedding is None
    assert [f for f, *_ in store.embeddings()] == [ids[0], ids[3], ids[4]]


def test_records_are_immutable(store):
    record, _ = store.add(ALICE, "x", embedding=[1.0])
    with pytest.raises(AttributeError):
        record.text = "y"
    with pytest.raises(ValueError):
        record.embedding[0] = 2.0
    assert isinstance(record, FactRecord) and record != store.add(ALICE, "y")[0]


# -- concurrency -----------------------------------------------------------------------------


def test_concurrent_adds_lose_nothing(store):
    errors = []
    barrier = threading.Barrier(10)

    def worker(t):
        try:
            barrier.wait()
            for i in range(50):
                store.add(Scope(f"user-{t % 3}"), f"thread {t} fact {i}", metadata={"t": t, "i": i})
        except Exception as e:  # surfaced below: a thread's exception would otherwise vanish
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(10)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    assert store.count() == 500
    records = store.list(limit=10_000)
    assert len({r.id for r in records}) == 500
    assert {(r.metadata["t"], r.metadata["i"]) for r in records} == {(t, i) for t in range(10) for i in range(50)}
    assert sum(store.count(user_id=f"user-{u}") for u in range(3)) == 500


def test_concurrent_duplicates_create_one_fact(store):
    results = []
    barrier = threading.Barrier(10)

    def worker():
        barrier.wait()
        results.append(store.add(ALICE, "the same fact"))

    threads = [threading.Thread(target=worker) for _ in range(10)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert sum(created for _, created in results) == 1
    assert len({r.id for r, _ in results}) == 1
    assert store.count() == 1


def test_offset_beyond_sqlite_integers_is_refused_and_the_largest_is_an_empty_page(store):
    with pytest.raises(InvalidInputError, match="offset"):
        store.list(offset=2**63)
    assert store.list(offset=2**63 - 1) == []


# -- schema migration ------------------------------------------------------------------------


def test_a_schema_1_store_migrates_and_keeps_every_fact_in_order(path):
    """Schema 1's CHECK refused kv_status 'evicted'; opening such a file rebuilds the table."""
    import sqlite3

    s = FactStore(path)
    for i in range(3):
        s.add_many([{"text": f"fact {i}", "scope": ALICE, "embedding": np.full(4, i, np.float32)}])
    s.set_kv_status(s.list(user_id="alice")[0].id, "encoded")
    before = s.list(user_id="alice")
    s.close()
    conn = sqlite3.connect(path)  # rewrite it as schema 1 wrote it: the old CHECK, user_version 1
    table = conn.execute("SELECT sql FROM sqlite_master WHERE name = 'facts'").fetchone()[0]
    old = table.replace(", 'evicted'", "")
    assert old != table
    conn.execute("PRAGMA writable_schema=ON")
    conn.execute("UPDATE sqlite_master SET sql = ? WHERE name = 'facts'", (old,))
    conn.commit()
    conn.execute("PRAGMA writable_schema=OFF")
    conn.execute("PRAGMA user_version=1")
    conn.close()
    with pytest.raises(sqlite3.IntegrityError):  # the old constraint is really in force
        raw = sqlite3.connect(path)
        raw.execute("UPDATE facts SET kv_status = 'evicted'")
        raw.commit()
    raw.close()

    s = FactStore(path)
    try:
        assert s.list(user_id="alice") == before
        assert s.set_kv_status(before[1].id, "evicted")
        assert s.get(before[1].id).kv_status == "evicted"
        assert [r.id for r in s.pending()] == [before[2].id]  # evicted facts wait for no encoder
    finally:
        s.close()


def test_a_schema_2_store_gains_origin_and_keeps_every_fact(path):
    """Schema 3 added column origin: a schema 2 file gets it, '' for every stored fact."""
    import sqlite3

    s = FactStore(path)
    s.add_many([{"text": f"fact {i}", "scope": ALICE, "context": "- before\n"} for i in range(3)])
    before = s.list(user_id="alice")
    s.close()
    conn = sqlite3.connect(path)
    conn.execute("ALTER TABLE facts DROP COLUMN origin")
    conn.execute("PRAGMA user_version=2")
    conn.close()
    s = FactStore(path)
    try:
        assert s.list(user_id="alice") == before and all(r.origin == "" for r in before)
        (record, _), = s.add_many([{"text": "Caroline went to a support group", "scope": ALICE,
                                    "origin": "Caroline: I went to an LGBTQ support group yesterday"}])
        assert s.get(record.id).origin.endswith("LGBTQ support group yesterday") and record.context == ""
        texts = {row[0]: row for row in s.texts()}
        assert texts[record.id][2:5] == ("Caroline went to a support group", "", record.origin)
    finally:
        s.close()
    with pytest.raises(InvalidInputError, match="origin must be a string"):
        FactStore(path).add(ALICE, "x", origin=3)


def test_a_schema_4_store_gains_history_source_and_keeps_its_history(path):
    """Schema 5 added history.source: a schema 4 file gets it, NULL (a caller's write) for every
    earlier event, and new events record theirs."""
    import sqlite3

    s = FactStore(path)
    (record, _), = s.add_many([{"text": "one", "scope": ALICE}])
    before = s.history(record.id)
    s.close()
    conn = sqlite3.connect(path)
    conn.execute("ALTER TABLE history DROP COLUMN source")
    conn.execute("PRAGMA user_version=4")
    conn.close()
    s = FactStore(path)
    try:
        assert s.history(record.id) == before and before[0].source is None
        s.delete_expired(0.0)  # nothing expired: no event
        s.set_expiry(record.id, 1.0)
        s.delete_expired(2.0)
        assert [(e.event, e.source) for e in s.history(record.id)] == [("ADD", None), ("DELETE", "expiry")]
    finally:
        s.close()
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == store_module.SCHEMA_VERSION


def test_usage_counts_round_trip_and_leave_with_their_fact(store):
    (a, _), (b, _) = store.add_many([{"text": t, "scope": ALICE} for t in ("one", "two")])
    store.save_usage({a.id: 3, b.id: 1, "f-gone": 7})  # a fact deleted meanwhile is skipped
    store.save_usage({a.id: 4})
    assert store.usage() == {a.id: 4, b.id: 1}
    store.delete(b.id)
    assert store.usage() == {a.id: 4}
    store.reset()
    assert store.usage() == {}


def test_a_newer_schema_is_refused(path):
    import sqlite3

    FactStore(path).close()
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version={store_module.SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(KvmemError, match="newer kvmem"):
        FactStore(path)


def test_sqlite_subscribe_is_a_no_op(path):
    """One process owns a SQLite file: there is no one else whose changes could be announced."""
    s = FactStore(path)
    seen = []
    stop = s.subscribe(seen.append)
    s.add(ALICE, "x")
    stop()
    s.close()
    assert seen == []
