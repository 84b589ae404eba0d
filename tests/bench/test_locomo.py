"""Reading LoCoMo and choosing the evaluated questions (no engine)."""

from collections import Counter

import pytest

from kvmem.bench import locomo
from kvmem.errors import InvalidInputError


@pytest.fixture
def conv(locomo_path):
    return next(c for c in locomo.load(locomo_path) if c["sample_id"] == "conv-26")


def test_a_limited_sample_covers_every_category_not_just_the_first_questions(conv):
    everything = locomo.questions(conv)
    sample = locomo.sample_questions(conv, 40)
    indices = [i for i, _ in sample]
    assert len(sample) == 40 and indices == sorted(set(indices))
    assert all(everything[i] is q for i, q in sample)
    # The file lists single-hop (category 4) questions last: the first 40 hold none of them.
    assert Counter(q["category"] for q in everything[:40])[4] == 0
    share = Counter(q["category"] for _, q in sample)[4] / 40
    assert abs(share - Counter(q["category"] for q in everything)[4] / len(everything)) < 0.2


def test_the_sample_is_fixed_by_its_seed(conv):
    assert locomo.sample_questions(conv, 10, seed=1) == locomo.sample_questions(conv, 10, seed=1)
    assert locomo.sample_questions(conv, 10, seed=1) != locomo.sample_questions(conv, 10, seed=2)
    assert len(locomo.sample_questions(conv, None)) == len(locomo.questions(conv))
    assert len(locomo.sample_questions(conv, 10_000)) == len(locomo.questions(conv))


def test_runs_over_different_conversations_never_share_a_resume_log():
    from pathlib import Path

    from kvmem.bench.eval_locomo import EvalConfig

    names = {EvalConfig(Path("d.json"), convs, limit=30).name
             for convs in [(), ("conv-26",), ("conv-30",), ("conv-26", "conv-30")]}
    assert len(names) == 4
    assert EvalConfig(Path("d.json"), ("conv-30", "conv-26")).name == EvalConfig(Path("d.json"), ("conv-26", "conv-30")).name
    assert EvalConfig(Path("d.json"), limit=30, seed=1).name != EvalConfig(Path("d.json"), limit=30).name


def test_runs_with_different_reader_adapters_never_share_a_resume_log(tmp_path):
    """Before, every adapter of a model wrote `<name>.<model>.reader.jsonl`: a run with a newly
    trained adapter resumed the old adapter's answers as its own."""
    from pathlib import Path

    from kvmem.bench.eval_locomo import EvalConfig, log_name

    cfg, model = EvalConfig(Path("d.json"), ("conv-42",), limit=10), "b09197e460a8" + "0" * 52
    folders = {}
    for name, weights in [("old", b"old weights"), ("new", b"new weights"), ("copy", b"old weights")]:
        folders[name] = tmp_path / name
        folders[name].mkdir()
        (folders[name] / "adapter_model.safetensors").write_bytes(weights)
    names = {k: log_name(cfg, model, f) for k, f in folders.items()}
    assert names["old"] != names["new"] and names["old"] == names["copy"]  # the weights decide, not the folder
    plain = log_name(cfg, model, None)
    assert plain == f"{cfg.name}.b09197e460a8.jsonl" and ".reader-" in names["old"]
    # KV mode with its last facts as text answers differently: a run (and its log) of its own.
    assert EvalConfig(Path("d.json"), ("conv-42",), limit=10, text_facts=1).name == cfg.name + "-text-facts-1"


def test_the_turns_before_an_observation_end_at_its_first_evidence_turn(conv):
    obs = next(o for o in locomo.observations(conv) if len(o.dia_ids) == 1 and o.dia_ids[0].endswith(":16"))
    window = locomo.turns_before(conv, obs.dia_ids, 2)
    assert [t["dia_id"] for t, _ in window] == ["D1:15", "D1:16"]
    assert all(date == obs.date for _, date in window)
    assert locomo.turns_before(conv, obs.dia_ids, 0) == []
    assert locomo.turns_before(conv, ("D99:1",), 2) == []  # unknown evidence: no context
    first = locomo.turns_before(conv, ("D1:1",), 4)
    assert [t["dia_id"] for t, _ in first] == ["D1:1"]  # nothing before the first turn


def test_default_windows_are_two_turns_for_turns_and_none_for_observations():
    from pathlib import Path

    from kvmem.bench.eval_locomo import EvalConfig

    assert EvalConfig(Path("d.json"), memory="turns").window_size == 2
    assert EvalConfig(Path("d.json")).window_size == 0
    assert EvalConfig(Path("d.json"), window=2).name == "locomo-observations-w2-k10"
    assert EvalConfig(Path("d.json"), memory="turns", window=0).window_size == 0


def test_missing_data_says_where_to_get_it(tmp_path):
    with pytest.raises(InvalidInputError, match="LoCoMo data not found.*--data") as err:
        locomo.load(tmp_path / "absent.json")
    assert err.value.param == "path"
