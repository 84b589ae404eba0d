"""`kvmem export` / `kvmem import` on real SQLite homes, through the command line's main().

The round trip is a property: whatever facts, metadata, updates and deletes a home went
through, exporting it and importing the file into an empty home gives back every fact (text,
scope, metadata, origin, context, times) and every history event, deleted facts' included; a
second import stores nothing. Imported facts are pending (their KV is made again) and searchable.
"""

from __future__ import annotations

import json
import tempfile
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvmem.cli import main
from kvmem.errors import InvalidInputError, UnknownFactError
from kvmem.facts import FactStore, Scope
from kvmem.facts.text import visible

# Fields the import makes anew rather than copies: the KV state, and the search vector (embedded again).
REMADE = {"kv_status", "kv_attempts", "embedding", "embedding_dim"}


def run(capsys, home: Path, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(["--home", str(home), *args])
    out, err = capsys.readouterr()
    return rc, out, err


# -- what a home can go through -----------------------------------------------------------------------

words = st.text(st.characters(exclude_categories=["Cs"]), max_size=12)
fact_texts = st.text(st.characters(exclude_categories=["Cs"]), min_size=1, max_size=24).filter(visible)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.floats(allow_nan=False, allow_infinity=False)
    | words,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(words, inner, max_size=3), max_leaves=5)
metadata = st.none() | st.dictionaries(words, json_values, max_size=3)
scopes = st.builds(Scope, st.sampled_from(["alice", "bob", "ü 名前"]), st.sampled_from([None, "agent-1"]),
                   st.sampled_from([None, "run-7"]))
event_times = st.none() | st.datetimes(datetime(1990, 1, 1), datetime(2040, 1, 1)).map(datetime.isoformat)
adds = st.fixed_dictionaries(
    {"scope": scopes, "text": fact_texts, "metadata": metadata},
    optional={"origin": words, "context": words, "event_time": event_times,
              "source": st.just("messages"), "position": st.integers(0, 50), "conversation_id": st.just("c-1")})
updates = st.tuples(st.just("update"), st.integers(0, 30), st.none() | fact_texts, metadata)
operations = st.lists(st.one_of(
    st.tuples(st.just("add"), adds),
    updates, updates,  # twice as likely: an update aimed at a deleted fact does nothing
    st.tuples(st.just("delete"), st.integers(0, 30)),
    st.tuples(st.just("delete_scope"), scopes),
    st.tuples(st.just("encoded"), st.integers(0, 30)),
    st.tuples(st.just("expire"), st.integers(0, 30), st.none() | st.floats(1e9, 4e9)),
), max_size=12)
# A few facts first, so that the operations after them have facts to update and delete.
steps = st.builds(lambda first, then: [("add", a) for a in first] + then, st.lists(adds, min_size=1, max_size=5),
                  operations)


def live_through(store: FactStore, history: list) -> list[str]:
    """Apply the steps to the store -> every fact id it ever held."""
    ids: list[str] = []
    for step in history:
        kind, *rest = step
        try:
            if kind == "add":
                record, created = store.add(**rest[0])
                ids += [record.id] if created else []
            elif ids and kind == "update":
                fact_id = ids[rest[0] % len(ids)]
                text = rest[1] if rest[1] is not None else store.get(fact_id).text
                store.update(fact_id, text, metadata=rest[2])
            elif ids and kind == "delete":
                store.delete(ids[rest[0] % len(ids)])
            elif kind == "delete_scope":
                store.delete_scope(rest[0])
            elif ids and kind == "encoded":
                store.set_kv_status(ids[rest[0] % len(ids)], "encoded")
            elif ids and kind == "expire":
                store.set_expiry(ids[rest[0] % len(ids)], rest[1])
        except (UnknownFactError, InvalidInputError):  # a deleted fact, a duplicate text: refused, nothing done
            pass
    return ids


def assert_same(a: FactStore, b: FactStore, ids: list[str]) -> None:
    for fact_id in ids:
        assert a.history(fact_id) == b.history(fact_id)
        try:
            old = a.get(fact_id)
        except UnknownFactError:
            with pytest.raises(UnknownFactError):
                b.get(fact_id)
            continue
        new = b.get(fact_id)
        assert {k: v for k, v in old.__dict__.items() if k not in REMADE} == \
               {k: v for k, v in new.__dict__.items() if k not in REMADE}
        assert new.kv_status == "pending" and new.kv_attempts == 0
        assert new.embedding is not None and new.embedding_dim == 384  # searchable at once
    for user in ("alice", "bob", "ü 名前"):  # the same order too
        assert [r.id for r in a.list(user_id=user, limit=1000)] == [r.id for r in b.list(user_id=user, limit=1000)]
    assert a.tally() == {**b.tally(), "without_vector": a.tally()["without_vector"],
                         "kv_status": a.tally()["kv_status"]}


@settings(max_examples=30, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(history=steps)
def test_export_then_import_into_an_empty_home_gives_back_every_fact_and_event(history, capsys):
    with tempfile.TemporaryDirectory(prefix="kvmem-transfer-") as tmp:
        first, second, dump = Path(tmp) / "a", Path(tmp) / "b", Path(tmp) / "all.jsonl"
        with FactStore(first / "facts.sqlite") as a:
            ids = live_through(a, history)
        rc, _, err = run(capsys, first, "export", "--all", "-o", str(dump))
        assert rc == 0, err
        rc, out, err = run(capsys, second, "import", str(dump))
        assert rc == 0, err
        with FactStore(first / "facts.sqlite") as a, FactStore(second / "facts.sqlite") as b:
            assert_same(a, b, ids)
            kinds = {e.event for i in ids for e in a.history(i)}
            event(f"history events: {'+'.join(sorted(kinds))}")  # --hypothesis-show-statistics: what was covered
            before = (b.tally(), [b.history(i) for i in ids])
        rc, out, err = run(capsys, second, "import", str(dump))  # idempotent: nothing new
        assert rc == 0 and out.startswith("imported 0 facts and 0 deleted facts' histories"), (out, err)
        with FactStore(second / "facts.sqlite") as b:
            assert (b.tally(), [b.history(i) for i in ids]) == before
        again = Path(tmp) / "again.jsonl"  # and the imported home exports the same lines
        assert run(capsys, second, "export", "--all", "-o", str(again))[0] == 0
        assert dump.read_text().splitlines()[1:] == again.read_text().splitlines()[1:]


def test_the_round_trip_through_postgresql(tmp_path, capsys, monkeypatch, pg_url):
    """The same SQL on the other backend: a SQLite home exported, imported into PostgreSQL, and
    exported from there again, line for line."""
    from kvmem.facts.pg import PgFactStore

    first, dump, again = tmp_path / "a", tmp_path / "all.jsonl", tmp_path / "again.jsonl"
    history = [("add", {"scope": Scope("alice"), "text": "Alice rows.", "metadata": {"k": [1, {"x": None}]},
                        "origin": "alice: I row"}),
               ("add", {"scope": Scope("alice", "agent-1", "run-7"), "text": "Alice sails.", "metadata": None}),
               ("add", {"scope": Scope("bob"), "text": "Bob hums.", "metadata": None}),
               ("update", 0, "Alice rows at dawn.", {"k": 2}), ("delete", 2), ("encoded", 1)]
    with FactStore(first / "facts.sqlite") as a:
        ids = live_through(a, history)
    assert run(capsys, first, "export", "--all", "-o", str(dump))[0] == 0
    monkeypatch.setenv("KVMEM_DATABASE_URL", pg_url)
    for _ in range(2):  # the second time, nothing new
        rc, out, err = run(capsys, tmp_path / "pg-home", "import", str(dump))
        assert rc == 0, err
    assert out.startswith("imported 0 facts and 0 deleted facts' histories; skipped 3 already here")
    with FactStore(first / "facts.sqlite") as a, PgFactStore(pg_url) as b:
        assert_same(a, b, ids)
    assert run(capsys, tmp_path / "pg-home", "export", "--all", "-o", str(again))[0] == 0
    assert dump.read_text().splitlines()[1:] == again.read_text().splitlines()[1:]


# -- one scope, search, bad lines ---------------------------------------------------------------------


@pytest.fixture
def home(tmp_path):
    """A home with alice (two facts, one updated, one deleted) and bob."""
    path = tmp_path / "home"
    with FactStore(path / "facts.sqlite") as store:
        dog, _ = store.add(Scope("alice"), "My dog is called Biscuit.", metadata={"topic": "pets"},
                           origin="alice: we got a dog!")
        store.add(Scope("alice", "travel-agent"), "I fly to Oslo in May.")
        gone, _ = store.add(Scope("alice"), "My old phone number is 555-0100.")
        store.update(dog.id, "My dog is called Biscuit; he is a beagle.")
        store.delete(gone.id)
        store.add(Scope("bob"), "Bob keeps bees.")
    return path


def test_export_of_one_user_and_search_after_import(home, tmp_path, capsys):
    rc, out, err = run(capsys, home, "export", "--user", "alice")
    assert rc == 0 and "exported 2 facts and 1 deleted facts' histories to stdout" in err
    header, *lines = [json.loads(line) for line in out.splitlines()]
    assert header["kvmem_export"] == 1 and header["scope"]["user_id"] == "alice"
    assert {line["user_id"] for line in lines} == {"alice"}
    (deleted,) = [line for line in lines if line.get("deleted")]
    assert [e["event"] for e in deleted["history"]] == ["ADD", "DELETE"]
    assert "555-0100" not in json.dumps(deleted)  # forgotten words do not travel

    dump = tmp_path / "alice.jsonl"
    dump.write_text(out)
    rc, out, _ = run(capsys, tmp_path / "new", "import", str(dump))
    assert rc == 0 and "imported 2 facts and 1 deleted facts' histories" in out and "pending" in out
    rc, out, _ = run(capsys, tmp_path / "new", "search", "--user", "alice", "--json", "What breed is my dog?")
    hits = [json.loads(line) for line in out.splitlines()]
    assert hits[0]["text"] == "My dog is called Biscuit; he is a beagle." and hits[0]["kv_status"] == "pending"
    rc, out, _ = run(capsys, tmp_path / "new", "search", "--user", "bob", "bees")
    assert rc == 0 and out.strip() == "no matching facts"  # only alice was exported


def test_import_skips_what_a_home_already_holds(home, tmp_path, capsys):
    dump = tmp_path / "all.jsonl"
    assert run(capsys, home, "export", "--all", "-o", str(dump))[0] == 0
    rc, out, _ = run(capsys, home, "import", str(dump))  # into the home it came from
    assert rc == 0 and out.startswith("imported 0 facts and 0 deleted facts' histories; skipped 4 already here")
    # A hand-written line: no id, no history; its text already stored in its scope -> a duplicate.
    extra = tmp_path / "extra.jsonl"
    extra.write_text(json.dumps({"user_id": "bob", "text": "Bob keeps bees."}) + "\n"
                     + json.dumps({"user_id": "bob", "text": "Bob sells honey.", "metadata": {"k": 1}}) + "\n")
    rc, out, _ = run(capsys, home, "import", str(extra))
    assert rc == 0 and "imported 1 facts" in out and "1 duplicates of facts stored here" in out
    with FactStore(home / "facts.sqlite") as store:
        (honey,) = [r for r in store.list(user_id="bob") if r.text == "Bob sells honey."]
        assert [e.event for e in store.history(honey.id)] == ["ADD"] and honey.metadata == {"k": 1}
    rc, out, _ = run(capsys, home, "import", str(extra))  # no ids, yet still idempotent: both are duplicates now
    assert rc == 0 and "imported 0 facts" in out and "2 duplicates" in out


BAD_LINES = [
    ('{"user_id": "carol", "text": "Carol likes tea."', "not valid JSON"),
    ('{"user_id": "carol", "text": "Carol has a cat.", "metadata": [1, 2]}', "metadata must be"),
    ('{"user_id": "carol", "text": "Carol sings.", "colour": "red"}', "unknown keys ['colour']"),
    ('{"id": "f-gone", "user_id": "carol", "deleted": true, "history": [{"event": "ADD", "old_text": null, '
     '"new_text": "Carol\'s secret", "at": 1.0}, {"event": "DELETE", "old_text": null, "new_text": null, '
     '"at": 2.0}]}', "a deleted fact's history holds no text"),
    ('{"user_id": "", "text": "Carol runs."}', "user_id must be"),
    ('{"id": "f-1", "user_id": "carol", "text": "Carol swims.", "created_at": "yesterday"}', "created_at must be"),
    ('{"id": "f-1", "user_id": "carol", "text": "Carol dives."}', "is on line 8 already"),
]


def test_a_malformed_line_is_reported_by_number_and_nothing_is_stored(tmp_path, capsys):
    good = [json.dumps({"user_id": "carol", "text": "Carol lives in Porto."}),
            json.dumps({"id": "f-1", "user_id": "carol", "text": "Carol reads.", "history": [
                {"event": "ADD", "old_text": None, "new_text": "Carol read.", "at": 1.0},
                {"event": "UPDATE", "old_text": "Carol read.", "new_text": "Carol reads.", "at": 2.0}]})]
    # Line 1 the header, 2 and 8 good, 3-7 and 9-10 bad (line 8 holds f-1 before line 10 repeats it).
    lines = ['{"kvmem_export": 1}', good[0], *(bad for bad, _ in BAD_LINES[:5]), good[1],
             *(bad for bad, _ in BAD_LINES[5:]), ""]
    dump = tmp_path / "bad.jsonl"
    dump.write_text("\n".join(lines))
    home = tmp_path / "home"
    rc, _, err = run(capsys, home, "import", str(dump))
    assert rc == 1
    numbers = [3, 4, 5, 6, 7, 9, 10]
    for number, (_, why) in zip(numbers, BAD_LINES):
        assert f"line {number}: " in err and why in err.split(f"line {number}: ")[1].splitlines()[0], err
    assert "line 2:" not in err and "line 8:" not in err
    assert "7 of 10 lines" in err and "nothing was imported" in err
    assert not (home / "facts.sqlite").exists()  # not even a home was made

    rc, out, _ = run(capsys, home, "import", "--dry-run", "--skip-invalid", str(dump))
    assert rc == 0 and "2 lines would be imported, 7 skipped as invalid" in out
    assert not (home / "facts.sqlite").exists()

    rc, out, err = run(capsys, home, "import", "--skip-invalid", str(dump))
    assert rc == 0 and "imported 2 facts" in out and "7 invalid lines" in out
    with FactStore(home / "facts.sqlite") as store:
        assert sorted(r.text for r in store.list()) == ["Carol lives in Porto.", "Carol reads."]
        assert [(e.event, e.new_text, e.at) for e in store.history("f-1")] == [
            ("ADD", "Carol read.", 1.0), ("UPDATE", "Carol reads.", 2.0)]
        with pytest.raises(UnknownFactError):
            store.history("f-gone")  # the bad deleted line left nothing, its history neither


def test_a_file_that_is_not_utf8_or_not_there(tmp_path, capsys):
    dump = tmp_path / "latin1.jsonl"
    dump.write_bytes(json.dumps({"user_id": "d", "text": "ok"}).encode() + b"\n"
                     + '{"user_id": "d", "text": "café"}'.encode("latin-1") + b"\n")
    rc, _, err = run(capsys, tmp_path / "h", "import", str(dump))
    assert rc == 1 and "line 2: not UTF-8 text" in err
    rc, _, err = run(capsys, tmp_path / "h", "import", str(tmp_path / "missing.jsonl"))
    assert rc == 1 and "cannot read" in err


def test_export_refuses_a_home_that_is_not_there_and_writes_whole_files(home, tmp_path, capsys):
    rc, _, err = run(capsys, tmp_path / "typo", "export", "--all")
    assert rc == 1 and "no kvmem home at" in err and not (tmp_path / "typo").exists()
    rc, _, err = run(capsys, home, "export", "--all", "--agent", "x")
    assert rc == 1 and "--agent and --run narrow a --user" in err
    target = tmp_path / "out.jsonl"
    assert run(capsys, home, "export", "--user", "alice", "--agent", "travel-agent", "-o", str(target))[0] == 0
    lines = [json.loads(line) for line in target.read_text().splitlines()]
    assert [line["text"] for line in lines[1:]] == ["I fly to Oslo in May."]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.jsonl")] == []  # no temp file left


def test_hand_written_times_are_kept(tmp_path, capsys):
    when = datetime(2024, 5, 1, 10, 0) - timedelta(days=1)
    dump = tmp_path / "t.jsonl"
    dump.write_text("\ufeff" + json.dumps({"id": "f-t", "user_id": "e", "text": "Eve was here.", "deleted": False,
                                          "created_at": when.timestamp()}) + "\n")  # an editor's BOM too
    assert run(capsys, tmp_path / "h", "import", str(dump))[0] == 0
    with FactStore(tmp_path / "h" / "facts.sqlite") as store:
        fact = store.get("f-t")
        assert fact.created_at == fact.updated_at == when.timestamp()
        assert [(e.event, e.at) for e in store.history("f-t")] == [("ADD", when.timestamp())]
