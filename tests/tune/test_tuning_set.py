"""The shipped tuning set: what the generator writes, readable as LoCoMo is, self-consistent, and
enough for `kvmem tune-reader` to train a map with no outside data."""

from __future__ import annotations

import json

from kvmem.bench import locomo
from kvmem.tune import tuning_set


def test_the_shipped_file_is_what_the_generator_writes(tmp_path):
    assert tuning_set.write(tmp_path / "t.json").read_text() == tuning_set.PATH.read_text()


def test_it_reads_as_locomo_and_its_citations_hold():
    convs = locomo.load(tuning_set.PATH)
    assert len(convs) == tuning_set.CONVERSATIONS and len({c["sample_id"] for c in convs}) == len(convs)
    for conv in convs:
        turns = {t["dia_id"]: t for _, ts, _ in locomo.sessions(conv) for t in ts}
        observations = locomo.observations(conv)
        assert observations and all(o.date and set(o.dia_ids) <= set(turns) for o in observations)
        for o in observations:  # each observation restates a turn its speaker said
            assert turns[o.dia_ids[0]]["speaker"] == o.speaker and o.text.startswith(o.speaker)
        questions = locomo.questions(conv)
        assert {q["category"] for q in questions} == {1, 2, 4}
        for q in questions:
            assert set(q["evidence"]) <= set(turns)
            if q["category"] == 4:  # a single-hop answer is in the turn it cites
                assert q["answer"] in turns[q["evidence"][0]]["text"]
        assert [q["category"] for q in questions][-1] == 4  # single-hop last, as in LoCoMo


def test_it_varies_in_size_and_topic():
    convs = locomo.load(tuning_set.PATH)
    sessions = [len(locomo.sessions(c)) for c in convs]
    sizes = [len(locomo.observations(c)) for c in convs]
    assert min(sessions) < max(sessions) and min(sizes) * 2 <= max(sizes)
    said = " ".join(t["text"] for c in convs for _, ts, _ in locomo.sessions(c) for t in ts)
    assert sum(fact[1].split("{")[0] in said for fact in tuning_set.FACTS) == len(tuning_set.FACTS)


def test_tune_reader_trains_a_map_on_it_with_no_outside_data(model_dir, tmp_path, capsys):
    """The command a user runs on a fresh install: no --data, no LoCoMo for the held-out side."""
    from kvmem.cli import main
    from kvmem.config import default_home
    from kvmem.reader import kvmap

    out, results = tmp_path / "adapter", tmp_path / "reader.json"
    argv = ["--home", str(tmp_path / "home"), "--models-home", str(default_home() / "models"), "tune-reader",
            "--conversations", "syn-03", "--limit", "2", "--memory", "observations", "-k", "3",
            "--eval-data", str(tmp_path / "no-locomo.json"), "--out", str(out), "--results", str(results)]
    assert main(argv) == 0
    assert "nothing measured" in capsys.readouterr().err
    result = json.loads(results.read_text())
    assert result["train_data"] == "shipped tuning set" and result["train_examples"] == 2
    assert "eval" not in result and kvmap.load(out) is not None
