"""`kvmem list | get | history | update | stats` on a real SQLite home, through main(); and the
promise of every no-engine command: the chat model is never resolved, converted or loaded."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import NamedTuple

import pytest

from kvmem.cli import main
from kvmem.config import default_home
from kvmem.facts import FactStore, Scope

ROOT = Path(__file__).resolve().parents[2]


class Home(NamedTuple):
    path: Path
    dog: str  # alice's updated fact
    gone: str  # alice's deleted fact


@pytest.fixture
def home(tmp_path):
    """alice: a dog fact (updated), a travel fact (agent), a deleted one; bob: one fact."""
    path = tmp_path / "home"
    with FactStore(path / "facts.sqlite") as store:
        dog, _ = store.add(Scope("alice"), "My dog is called Biscuit.", metadata={"topic": "pets"},
                           origin="alice: we got a dog!")
        store.add(Scope("alice", "travel-agent"), "I fly to Oslo in May.\nThen Bergen.", metadata={"topic": "trips"})
        gone, _ = store.add(Scope("alice"), "My old phone number is 555-0100.")
        store.update(dog.id, "My dog is called Biscuit; he is a beagle.")
        store.delete(gone.id)
        store.add(Scope("bob"), "Bob keeps bees.")
    return Home(path, dog.id, gone.id)


@pytest.fixture
def kvmem(home, capsys):
    def run(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        rc = main(["--home", str(home.path), "--models-home", str(default_home() / "models"), *args])
        out, err = capsys.readouterr()
        return rc, out, err

    return run


def test_list_pages_through_one_user_or_everyone(kvmem, home):
    rc, out, _ = kvmem("list", "--user", "alice")
    assert rc == 0
    head, *rows, footer = out.splitlines()
    assert head.split() == ["id", "kv", "created", "text"]
    assert [r.split("  ")[-1] for r in rows] == ["My dog is called Biscuit; he is a beagle.",
                                                 "I fly to Oslo in May. \u23ce Then Bergen."]
    assert footer == "facts 1-2 of 2"
    rc, out, _ = kvmem("list", "--limit", "2")
    head, *rows, footer = out.splitlines()
    assert head.split()[:2] == ["id", "user"] and [r.split()[1] for r in rows] == ["alice", "alice"]
    assert footer == "facts 1-2 of 3; --offset 2 for more"
    rc, out, _ = kvmem("list", "--offset", "2", "--json")
    assert [json.loads(line)["text"] for line in out.splitlines()] == ["Bob keeps bees."]
    rc, out, _ = kvmem("list", "--user", "alice", "--agent", "travel-agent", "--json")
    assert [json.loads(line)["agent_id"] for line in out.splitlines()] == ["travel-agent"]
    rc, out, _ = kvmem("list", "--user", "alice", "--filters", '{"topic": "pets"}', "--json")
    (fact,) = [json.loads(line) for line in out.splitlines()]
    assert fact["id"] == home.dog and fact["origin"] == "alice: we got a dog!" and "embedding" not in fact
    assert kvmem("list", "--user", "carol")[1].strip() == "no facts"
    rc, _, err = kvmem("list", "--agent", "travel-agent")
    assert rc == 1 and "--agent and --run narrow a --user" in err


def test_read_commands_refuse_a_home_that_is_not_there(tmp_path, capsys):
    for args in (["list"], ["get", "f-1"], ["history", "f-1"], ["stats"], ["update", "f-1", "x"]):
        assert main(["--home", str(tmp_path / "typo"), *args]) == 1
        assert "no kvmem home at" in capsys.readouterr().err
    assert not (tmp_path / "typo").exists()


def test_get_shows_every_field_and_the_blob_on_disk(kvmem, home):
    dog = home.dog
    blob = home.path / "kv" / "0123456789abcdef" / f"{dog}.safetensors"  # where the KV store keeps a blob
    blob.parent.mkdir(parents=True)
    blob.write_bytes(b"\0" * 1000)
    rc, out, _ = kvmem("get", dog)
    assert rc == 0
    fields = dict(line.split(None, 1) if not line.startswith("event time") else ("event time", line[12:])
                  for line in out.splitlines())
    assert fields["text"] == "My dog is called Biscuit; he is a beagle."
    assert fields["metadata"] == '{"topic": "pets"}' and fields["origin"] == "alice: we got a dog!"
    assert fields["kv"] == "pending (attempts 0); blob on disk: 1,000 bytes"
    rc, out, _ = kvmem("get", "--json", dog)
    record = json.loads(out)
    assert (record["user_id"], record["kv_blob_bytes"], record["kv_status"]) == ("alice", 1000, "pending")
    rc, _, err = kvmem("get", home.gone)
    assert rc == 1 and "was deleted on" in err and f"kvmem history {home.gone}" in err
    rc, _, err = kvmem("get", dog, "f-nope")
    assert rc == 1 and "unknown fact id 'f-nope'" in err


def test_history_keeps_a_deleted_fact_without_its_words(kvmem, home):
    rc, out, _ = kvmem("history", home.dog)
    assert rc == 0
    assert [line.split("  ", 1)[1] for line in out.splitlines()] == [
        "ADD     My dog is called Biscuit.",
        "UPDATE  My dog is called Biscuit.  ->  My dog is called Biscuit; he is a beagle."]
    rc, out, _ = kvmem("history", home.gone)
    assert [line.split("  ", 1)[1] for line in out.splitlines()] == ["ADD     (text forgotten)", "DELETE"]
    rc, out, _ = kvmem("history", "--json", home.gone)
    assert [json.loads(line)["event"] for line in out.splitlines()] == ["ADD", "DELETE"]
    assert "555-0100" not in out  # (a bare "555" can be digits of a time)
    assert kvmem("history", "f-nope")[0] == 1


def test_update_text_and_metadata_without_an_engine(kvmem, home):
    dog = home.dog
    rc, out, _ = kvmem("update", dog, "My dog Biscuit is a beagle who loves the beach.")
    assert rc == 0 and "its KV is pending" in out
    rc, out, _ = kvmem("update", dog, "--metadata", '{"topic": "pets", "breed": "beagle"}')
    assert rc == 0 and 'updated the metadata' in out
    assert "nothing changed" in kvmem("update", dog, "My dog Biscuit is a beagle who loves the beach.")[1]
    with FactStore(home.path / "facts.sqlite") as store:
        fact = store.get(dog)
        assert (fact.text, fact.metadata, fact.kv_status) == (
            "My dog Biscuit is a beagle who loves the beach.", {"topic": "pets", "breed": "beagle"}, "pending")
        assert [e.event for e in store.history(dog)] == ["ADD", "UPDATE", "UPDATE", "UPDATE"]  # the fixture updated it once
    rc, out, _ = kvmem("search", "--user", "alice", "--json", "-k", "1", "Where does the dog like to go?")
    assert json.loads(out)["id"] == dog  # re-embedded and re-indexed
    rc, _, err = kvmem("update", dog)
    assert rc == 1 and "give the new TEXT, --metadata JSON, or both" in err
    rc, _, err = kvmem("update", dog, "--metadata", "[1]")
    assert rc == 1 and "--metadata must be a JSON object" in err
    assert kvmem("update", home.gone, "back again")[0] == 1


def test_stats_counts_facts_history_and_blobs(kvmem, home):
    with FactStore(home.path / "facts.sqlite") as store:
        store.set_kv_status(home.dog, "encoded")
    blob = home.path / "kv" / "0123456789abcdef" / f"{home.dog}.safetensors"
    blob.parent.mkdir(parents=True)
    blob.write_bytes(b"\0" * 2048)
    rc, out, _ = kvmem("stats", "--json")
    numbers = json.loads(out)
    assert numbers["facts"] == 3 and numbers["kv_status"] == {"pending": 2, "encoded": 1, "failed": 0, "evicted": 0}
    assert (numbers["users"], numbers["scopes"], numbers["deleted_facts"]) == (2, 3, 1)
    assert numbers["history_events"] == 6  # 4 ADDs, 1 UPDATE, 1 DELETE
    assert (numbers["kv_blobs"], numbers["kv_bytes"]) == (1, 2048)
    assert numbers["top_users"] == {"alice": 2, "bob": 1}
    rc, out, _ = kvmem("stats", "--user", "bob")
    rows = dict(line.split(None, 1) for line in out.splitlines() if not line.startswith("kv blobs"))
    assert rows["facts"].startswith("1 (pending 1") and "kv blobs   0 on disk, 0 bytes" in out
    assert "top" not in rows


def test_no_engine_command_resolves_or_loads_the_chat_model(home, tmp_path):
    """One fresh process runs every store-only command, search and import with an empty
    --models-home: resolving the bundled model would convert it there. Afterwards neither vLLM
    nor the engine, the chat room or the service facade was imported."""
    dump, models = tmp_path / "dump.jsonl", tmp_path / "no-models"
    script = textwrap.dedent(f"""
        import sys
        from kvmem.cli import main
        common = ["--home", {str(home.path)!r}, "--models-home", {str(models)!r}]
        commands = [["list"], ["get", {home.dog!r}], ["history", {home.dog!r}], ["stats"],
                    ["search", "--user", "alice", "dog"], ["export", "--all", "-o", {str(dump)!r}],
                    ["--home", {str(tmp_path / "other")!r}, "import", {str(dump)!r}]]
        for args in commands:
            assert main([*common, *args]) == 0, args
        loaded = sorted(m for m in sys.modules if m.split(".")[0] == "vllm"
                        or m in ("kvmem.service", "kvmem.engine", "kvmem.chat", "kvmem.encoding", "kvmem.model"))
        print("LOADED", loaded)
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "LOADED []"
    assert not models.exists()


def test_reading_commands_import_no_torch(home, tmp_path):
    """list, get, history, stats and search start in a fraction of a second because they never
    import torch or transformers (the query is embedded in NumPy: embed/numpy_minilm.py)."""
    script = textwrap.dedent(f"""
        import sys
        from kvmem.cli import main
        common = ["--home", {str(home.path)!r}, "--models-home", {str(tmp_path / "no-models")!r}]
        for args in (["list"], ["get", {home.dog!r}], ["history", {home.dog!r}], ["stats"],
                     ["search", "--user", "alice", "dog"]):
            assert main([*common, *args]) == 0, args
        print("LOADED", sorted(m for m in ("torch", "transformers") if m in sys.modules))
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "LOADED []"
    assert "Biscuit" in done.stdout  # search still finds the dog
