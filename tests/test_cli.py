"""The kvmem command line, driven in-process. Only the chat test starts an engine."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest

from kvmem.cli import main
from kvmem.config import default_home

DOG = "My dog is called Biscuit."
JOB = "I work as a nurse at Santa Maria hospital."
CELLO = "I play the cello every Thursday evening."
ID = re.compile(r"^(f-[0-9a-f]+)\s+(new|duplicate)\s+(.*)$")


@pytest.fixture
def kvmem(tmp_path, capsys):
    """kvmem(*args) -> (exit code, stdout, stderr), on a fresh data folder and the shared model cache."""
    base = ["--home", str(tmp_path / "home"), "--models-home", str(default_home() / "models")]

    def run(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()  # drop anything printed before
        rc = main([*base, *args])
        out, err = capsys.readouterr()
        return rc, out, err

    return run


def added(out: str) -> list[tuple[str, str, str]]:
    """(id, 'new'|'duplicate', text) for each fact line `kvmem add` printed."""
    return [m.groups() for line in out.splitlines() if (m := ID.match(line))]


def search_json(kvmem, query: str, *extra: str) -> list[dict]:
    rc, out, _ = kvmem("search", "--user", "alice", "--json", *extra, query)
    assert rc == 0
    return [json.loads(line) for line in out.splitlines()]


def test_add_without_encoding_stores_facts_and_reports_duplicates(kvmem):
    rc, out, _ = kvmem("add", "--user", "alice", "--no-encode", DOG, JOB, DOG)
    assert rc == 0
    lines = added(out)
    assert [(s, t) for _, s, t in lines] == [("new", DOG), ("new", JOB), ("duplicate", DOG)]
    assert lines[0][0] == lines[2][0]  # the duplicate is the stored fact
    assert "2 created, 1 duplicates" in out and "left pending" in out

    rc, out, _ = kvmem("add", "--user", "alice", "--no-encode", f"  {DOG}  ", CELLO)
    assert rc == 0
    assert [(i, s) for i, s, _ in added(out)][0] == (lines[0][0], "duplicate")
    assert [s for _, s, _ in added(out)] == ["duplicate", "new"]
    assert "1 created, 1 duplicates" in out

    hits = search_json(kvmem, "anything", "-k", "10")
    assert sorted(h["text"] for h in hits) == sorted([DOG, JOB, CELLO])
    assert {h["kv_status"] for h in hits} == {"pending"}  # searchable at once, encoded later


def test_add_a_conversation_from_a_file_and_from_stdin(kvmem, tmp_path, monkeypatch):
    conversation = [
        {"role": "user", "content": "My sister adopted a puppy.", "timestamp": "2024-05-01T10:00:00"},
        {"role": "assistant", "content": "How exciting!"},
        {"role": "user", "content": "She named it Bruno.", "name": "Alice"},
    ]
    path = tmp_path / "chat.json"
    path.write_text(json.dumps(conversation))
    rc, out, _ = kvmem("add", "--user", "alice", "--no-encode", "--window", "1", "--metadata", '{"topic": "pets"}',
                       "--messages", str(path))
    assert rc == 0
    assert [t for _, _, t in added(out)] == [
        "[1 May 2024, 10:00] user: My sister adopted a puppy.",
        "assistant: How exciting!",
        "Alice: She named it Bruno.",
    ]
    assert "3 created, 0 duplicates" in out

    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps({"messages": conversation + [
        {"role": "user", "content": "Bruno is a beagle."}]})))
    rc, out, _ = kvmem("add", "--user", "alice", "--no-encode", "--messages", "-")
    assert rc == 0
    assert [s for _, s, _ in added(out)] == ["duplicate", "duplicate", "duplicate", "new"]

    pets = search_json(kvmem, "puppy", "-k", "10", "--filters", '{"topic": "pets"}')
    assert len(pets) == 3 and all(h["metadata"]["topic"] == "pets" for h in pets)
    stamped = [h for h in pets if h["text"].startswith("[1 May 2024, 10:00]")]
    assert [h["metadata"] for h in stamped] == [{"topic": "pets", "timestamp": "2024-05-01T10:00:00"}]

    rc, out, _ = kvmem("add", "--user", "alice", "--no-encode", "--timestamp", "2024-06-02", "Bruno learnt to sit.")
    assert rc == 0 and [t for _, _, t in added(out)] == ["[2 June 2024] Bruno learnt to sit."]
    rc, _, err = kvmem("add", "--user", "alice", "--no-encode", "--timestamp", "2024-06-02", "--messages", str(path))
    assert rc != 0 and "--timestamp applies to facts" in err
    said = "alice: the trainer at the Riverside kennel club says he is a natural"
    rc, out, _ = kvmem("add", "--user", "alice", "--no-encode", "--origin", said, "Bruno is good at training.")
    assert rc == 0 and added(out)[0][1] == "new"
    assert [h["text"] for h in search_json(kvmem, "Riverside kennel", "-k", "1")] == ["Bruno is good at training."]
    rc, _, err = kvmem("add", "--user", "alice", "--no-encode", "--origin", said, "--messages", str(path))
    assert rc != 0 and "--origin applies to facts" in err


def test_search_prints_a_ranked_table_or_json_lines(kvmem):
    assert kvmem("add", "--user", "alice", "--no-encode", DOG, JOB, CELLO)[0] == 0
    kvmem("add", "--user", "bob", "--no-encode", "My dog is called Rex.")

    rc, out, _ = kvmem("search", "--user", "alice", "-k", "2", "What is my dog called?")
    assert rc == 0
    header, *rows = out.splitlines()
    assert header.split()[:4] == ["rank", "score", "kv", "id"]
    assert len(rows) == 2
    rank, score, status, fact_id, *text = rows[0].split()
    assert (rank, status, " ".join(text)) == ("1", "pending", DOG)
    assert re.fullmatch(r"-?\d\.\d{3}", score) and fact_id.startswith("f-")

    hits = search_json(kvmem, "Which instrument do I play?")
    assert hits[0]["text"] == CELLO and hits[0]["rank"] == 1
    assert [h["rank"] for h in hits] == [1, 2, 3]  # only alice's three facts, never bob's
    assert hits[0]["score"] > hits[1]["score"]


def test_forget_by_id_and_all(kvmem):
    rc, out, _ = kvmem("add", "--user", "alice", "--no-encode", DOG, JOB, CELLO)
    dog_id, job_id, _ = (i for i, _, _ in added(out))

    rc, out, _ = kvmem("forget", "--user", "alice", dog_id, job_id)
    assert rc == 0
    assert f"forgot {dog_id}  {DOG}" in out and f"forgot {job_id}  {JOB}" in out
    assert [h["text"] for h in search_json(kvmem, "dog")] == [CELLO]

    rc, out, _ = kvmem("forget", "--user", "alice", "--all")
    assert rc == 0 and "forgot 1 facts of user 'alice'" in out
    assert search_json(kvmem, "cello") == []
    rc, out, _ = kvmem("search", "--user", "alice", "cello")
    assert rc == 0 and out.strip() == "no matching facts"


def test_reembed_rewrites_every_facts_vector_or_one_users(kvmem):
    kvmem("add", "--user", "alice", "--no-encode", DOG, JOB)
    kvmem("add", "--user", "bob", "--no-encode", CELLO)
    before = search_json(kvmem, "dog")
    rc, out, err = kvmem("reembed")
    assert rc == 0 and "re-embedded 3 facts" in out and "re-embedding facts" in err  # a progress bar
    rc, out, _ = kvmem("reembed", "--user", "bob", "--batch", "1")
    assert rc == 0 and "re-embedded 1 facts of user 'bob'" in out
    assert [h["id"] for h in search_json(kvmem, "dog")] == [h["id"] for h in before]
    with pytest.raises(SystemExit) as exit_:
        kvmem("reembed", "--batch", "0")
    assert exit_.value.code == 2


def test_bad_input_exits_1_with_the_error_on_stderr(kvmem):
    rc, out, err = kvmem("add", "--user", "alice", "--no-encode", DOG, "   ")
    assert rc == 1 and err.strip() == "kvmem: fact must be a non-empty string"
    assert search_json(kvmem, "dog") == []  # nothing half-stored

    rc, _, err = kvmem("add", "--user", "alice", "--no-encode", "--metadata", "{not json", DOG)
    assert rc == 1 and err.startswith("kvmem: --metadata is not valid JSON")

    rc, _, err = kvmem("add", "--user", "alice", "--no-encode")
    assert rc == 1 and "not both and not neither" in err

    rc, out, _ = kvmem("add", "--user", "bob", "--no-encode", "Bob's secret is 1234.")
    ((bob_fact, _, _),) = added(out)
    rc, out, err = kvmem("forget", "--user", "alice", bob_fact)
    assert rc == 1 and err.strip() == f"kvmem: fact {bob_fact!r} does not belong to user 'alice'; nothing was forgotten"
    assert "1234" not in err + out
    rc, out, _ = kvmem("search", "--user", "bob", "--json", "secret")
    assert json.loads(out.splitlines()[0])["id"] == bob_fact  # still there

    rc, _, err = kvmem("forget", "--user", "alice", "f-doesnotexist")
    assert rc == 1 and err.strip() == "kvmem: unknown fact id 'f-doesnotexist'"


def test_chat_answers_each_line_with_the_users_facts_injected(kvmem, monkeypatch):
    """The one engine-backed test: facts stored with --no-encode are encoded when chat starts."""
    assert kvmem("add", "--user", "alice", "--no-encode", JOB, DOG, CELLO, "I live in Lisbon.")[0] == 0
    stdin = "What is my dog called?\n\nWhere do I work?\n/quit\nThis line is never read.\n"
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    rc, out, err = kvmem("chat", "--user", "alice", "--mode", "kv", "-k", "3", "--max-tokens", "24")
    assert rc == 0, err
    lines = out.splitlines()
    answers = [i for i, line in enumerate(lines) if line.startswith("assistant> ")]
    assert len(answers) == 2  # the empty line is skipped, /quit ends the chat
    assert all(lines[i][len("assistant> "):].strip() for i in answers)
    details = [lines[i + 1] for i in answers]
    assert DOG in details[0] and "[1] " in details[0] and "[4]" not in details[0]  # k=3
    for line in details:
        m = re.search(r"TTFT (\d+\.\d) ms, (\d+) tokens injected, (\d+) fallbacks", line)
        assert m, line
        assert int(m[2]) > 0 and m[3] == "0"  # pending facts were encoded before the first question
    rc, out, _ = kvmem("search", "--user", "alice", "dog")
    assert "pending" not in out and "encoded" in out


def test_tune_reader_refuses_to_train_nothing(kvmem, capsys):
    with pytest.raises(SystemExit) as exit_:
        kvmem("tune-reader", "--no-kv-map")
    assert "nothing to train: no LoRA targets and no KV map" in str(exit_.value)


def test_tune_reader_refuses_a_first_weight_of_zero(kvmem, capsys):
    with pytest.raises(SystemExit) as exit_:
        kvmem("tune-reader", "--first-weight", "0")
    assert exit_.value.code == 2 and "--first-weight: must be > 0, got 0" in capsys.readouterr().err


def test_tune_reader_keeps_the_shipped_scale_at_any_rank_unless_told():
    from kvmem.cli import build_parser
    from kvmem.tune.cli import tune_config

    parse = build_parser().parse_args
    assert (tune_config(parse(["tune-reader"])).alpha, tune_config(parse(["tune-reader"])).rank) == (16.0, 8)
    assert tune_config(parse(["tune-reader", "--rank", "32"])).alpha == 64.0
    assert tune_config(parse(["tune-reader", "--rank", "32", "--alpha", "8"])).alpha == 8.0


def test_tune_reader_targets_are_checked_and_kept_in_peft_order(capsys):
    from kvmem.cli import build_parser
    from kvmem.tune.cli import tune_config

    parse = build_parser().parse_args
    assert tune_config(parse(["tune-reader"])).targets == ()  # the KV map alone by default
    assert tune_config(parse(["tune-reader", "--targets", "none"])).targets == ()
    assert tune_config(parse(["tune-reader", "--targets", "q_proj"])).targets == ("q_proj",)
    assert tune_config(parse(["tune-reader", "--targets", "o_proj,q_proj"])).targets == ("q_proj", "o_proj")
    with pytest.raises(SystemExit) as exit_:
        parse(["tune-reader", "--targets", "q_proj,lm_head"])
    assert exit_.value.code == 2 and "expected names among q_proj" in capsys.readouterr().err


def test_tune_reader_memories_are_checked_and_kept_in_order_once(capsys):
    from kvmem.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["tune-reader"]).memory == ("observations", "both")  # what the shipped map was trained on
    assert parse(["tune-reader", "--memory", "both,observations,both"]).memory == ("both", "observations")
    with pytest.raises(SystemExit) as exit_:
        parse(["tune-reader", "--memory", "observations,facts"])
    assert exit_.value.code == 2 and "expected names among observations,turns,both" in capsys.readouterr().err


def test_tune_reader_refuses_a_model_whose_rotary_it_cannot_move_before_any_work(kvmem, model_dir, tmp_path):
    """An interleaved-rotary model (GPT-J) would train a map serving refuses: refused before any
    data is read (partial rotary, which used to be refused here, now trains: tests/tune/test_lab.py)."""
    from tests.engine.test_families import make_model_dir

    gptj = make_model_dir(tmp_path, "gptj", Path(model_dir))
    with pytest.raises(SystemExit) as exit_:
        kvmem("--model", str(gptj), "tune-reader", "--data", str(tmp_path / "no-such-locomo.json"))
    assert "interleaved rotary embeddings" in str(exit_.value)


def test_home_after_the_command_is_the_folder_home_before_it_names(tmp_path, capsys):
    """The data-folder flag works on either side of the subcommand (tests/cli checks every one)."""
    home, models = str(tmp_path / "home"), str(default_home() / "models")
    assert main(["add", "--user", "alice", "--no-encode", "--home", home, "--models-home", models, DOG]) == 0
    capsys.readouterr()
    assert main(["--home", home, "--models-home", models, "search", "--user", "alice", "--json", "dog"]) == 0
    assert [json.loads(line)["text"] for line in capsys.readouterr().out.splitlines()] == [DOG]
