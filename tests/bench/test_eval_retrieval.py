"""`kvmem eval retrieval` on the synthetic LoCoMo-shaped fixture: what each memory stores and the
novel-hits rule (no engine)."""

from __future__ import annotations

import pytest

from kvmem.bench import eval_retrieval, locomo
from kvmem.config import Config
from kvmem.errors import InvalidInputError
from kvmem.facts.messages import turn_text
from kvmem.service import KVMem


@pytest.fixture
def mem(tmp_path, model_dir):
    with KVMem(Config(home=tmp_path / "home", models_home=model_dir.parent), start_engine=False) as m:
        yield m


def test_novel_keeps_only_hits_that_add_a_source():
    sources = [{"D1:3"}, {"D1:3"}, {"D1:3", "D1:5"}, {"D1:5"}, {"D2:1"}, {"D2:2"}]
    assert eval_retrieval.novel(sources, k=10) == [0, 2, 4, 5]
    assert eval_retrieval.novel(sources, k=2) == [0, 2]


def test_both_memories_store_observations_and_turns(mem, locomo_path):
    conv = next(c for c in locomo.load(locomo_path) if c["sample_id"] == "conv-26")
    sizes = {m: len(mem.get_all(user_id=eval_retrieval.build(mem, conv, m), limit=10_000))
             for m in eval_retrieval.MEMORIES}
    observations = {f"[{o.date}] {o.text}" for o in locomo.observations(conv)}  # the store keeps one per text
    turns = {turn_text(locomo.message(conv, t, date)) for _, ts, date in locomo.sessions(conv) for t in ts}
    assert sizes["observations"] == len(observations) > 0
    assert sizes["turns"] == len(turns) > 0
    assert sizes["both"] == len(observations | turns)


def test_novel_hits_never_lower_recall_at_the_largest_k(mem, locomo_path):
    plain = eval_retrieval.run(mem, locomo_path, ("conv-26",), rankings=("dense",), memory="both")
    novel = eval_retrieval.run(mem, locomo_path, ("conv-26",), rankings=("dense",), memory="both", novel_only=True)
    assert plain["questions"] == novel["questions"] > 0
    top = str(max(eval_retrieval.KS))
    assert novel["recall"]["dense"]["overall"][top] >= plain["recall"]["dense"]["overall"][top]
    with pytest.raises(InvalidInputError):
        eval_retrieval.run(mem, locomo_path, ("conv-26",), memory="everything")


def test_observations_are_stored_after_the_turn_they_restate_with_an_observation_window(mem, locomo_path):
    conv = next(c for c in locomo.load(locomo_path) if c["sample_id"] == "conv-26")
    bare = mem.get_all(user_id=eval_retrieval.build(mem, conv, "observations"), limit=10_000)
    user = eval_retrieval.build(mem, conv, "both", observation_window=1)
    assert user.endswith("-both-w2-o1")
    records = mem.get_all(user_id=user, limit=10_000)
    turns = {f"D{r.metadata['session']}:{r.position + 1}": r.text for r in records if "session" in r.metadata}
    observations = [r for r in records if "dia_ids" in r.metadata]
    assert all(not r.context for r in bare) and len(observations) == len(bare)
    for r in observations:  # the context is the first evidence turn, as its turn fact shows it
        first = min(r.metadata["dia_ids"], key=lambda d: tuple(int(x) for x in d[1:].split(":")))
        assert r.context == mem.config.prompt.fact_template.format(text=turns[first])
    drawn = mem.get_all(user_id=eval_retrieval.build(mem, conv, "observations", observation_origin=True), limit=10_000)
    assert [r.origin for r in drawn] == [r.context for r in observations] and all(not r.context for r in drawn)
    with pytest.raises(InvalidInputError):
        eval_retrieval.run(mem, locomo_path, ("conv-26",), memory="both", observation_window=-1)
