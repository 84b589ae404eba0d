"""Training chats from LoCoMo-shaped data: QA questions and the conversation's own question turns."""

from __future__ import annotations

import json

import pytest

from kvmem.config import Config, KVConfig
from kvmem.tune.examples import locomo_examples
from kvmem.service import KVMem

ASKED = {"D1:3": "How did the pottery class go?", "D2:5": "Did you ever fix that blue bicycle?",
         "D3:8": "Where in Lisbon was the half marathon?"}


@pytest.fixture()
def asking(tmp_path, locomo_path, model_dir):
    """The synthetic conversations with three turns turned into questions, and a service on them."""
    data = json.loads(locomo_path.read_text())
    for conv in data:
        for key, turns in conv["conversation"].items():
            for turn in turns if isinstance(turns, list) else ():
                if conv["sample_id"] == "conv-26" and turn["dia_id"] in ("D1:3", "D2:5") or \
                        conv["sample_id"] == "conv-30" and turn["dia_id"] == "D3:8":
                    turn["text"] = ASKED[turn["dia_id"]]
    path = tmp_path / "asking.json"
    path.write_text(json.dumps(data))
    config = Config(home=tmp_path / "home", models_home=model_dir.parent, kv=KVConfig(reader_adapter="off"))
    with KVMem(config, start_engine=False, background=False) as mem:
        yield mem, path


def test_question_turns_become_chats_over_their_retrieved_facts(asking):
    mem, path = asking
    out = locomo_examples(mem, path, ("conv-26", "conv-30"), k=3, asked="turns")
    # turns numbered across sessions (20 per session): D1:3 -> 2, D2:5 -> 24, D3:8 -> 47
    assert [key for key, _ in out] == ["conv-26#t2", "conv-26#t24", "conv-30#t47"]
    tokenizer = mem.prompts.tokenizer
    for (_, ex), question in zip(out, [ASKED["D1:3"], ASKED["D2:5"], ASKED["D3:8"]]):
        assert question in tokenizer.decode(list(ex.tail))
        assert len(ex.facts) == 3
    fact_texts = [tokenizer.decode(list(fact)) for _, fact in out[0][1].facts]
    assert any("pottery" in t for t in fact_texts), fact_texts  # retrieved for the turn's words
    questions = locomo_examples(mem, path, ("conv-26",), k=3, limit=5)
    assert [key for key, _ in questions] and all("#t" not in key for key, _ in questions)


def test_a_limit_draws_the_same_turns_every_time(asking):
    mem, path = asking
    one = locomo_examples(mem, path, ("conv-26",), k=2, limit=1, asked="turns", seed=3)
    again = locomo_examples(mem, path, ("conv-26",), k=2, limit=1, asked="turns", seed=3)
    assert len(one) == 1 and [k for k, _ in one] == [k for k, _ in again]
    assert one[0][0] in ("conv-26#t2", "conv-26#t24")
    with pytest.raises(ValueError, match="asked must be one of"):
        locomo_examples(mem, path, ("conv-26",), asked="answers")


def test_memory_both_gives_chats_whose_turn_facts_carry_their_context(asking):
    """tune-reader --memory both trains on what turn memory serves: turns encoded after the turns before them."""
    mem, path = asking
    observations = locomo_examples(mem, path, ("conv-26",), k=6, limit=3)
    both = locomo_examples(mem, path, ("conv-26",), k=6, limit=3, memory="both")
    assert [key for key, _ in observations] == [key for key, _ in both]  # the same questions
    assert all(not context for _, ex in observations for context, _ in ex.facts)
    assert any(context for _, ex in both for context, _ in ex.facts)
