"""`kvmem eval extract` and `eval locomo --memory extracted` on the real engine (the session's
SmolLM2-135M) over the synthetic LoCoMo-shaped fixture: what the bundled model extracts is not
pinned, only what the eval counts and that it resumes without asking the model again."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from kvmem.bench import eval_extract, eval_locomo, locomo
from kvmem.bench.eval_extract import ExtractEvalConfig
from kvmem.errors import InvalidInputError


@pytest.fixture(scope="module")
def extracted(mem, locomo_path, tmp_path_factory):
    """conv-26 of the fixture, its first 2 sessions (of 3, 20 turns each; the suite's time), added
    through infer, 8 turns per call."""
    out = tmp_path_factory.mktemp("extract")
    cfg = ExtractEvalConfig(locomo_path, ("conv-26",), sessions=2)
    return cfg, out, eval_extract.run(mem, cfg, out)


def test_every_call_is_logged_and_the_memory_sizes_add_up(mem, extracted, locomo_path):
    cfg, out, result = extracted
    conv = result["conversations"]["conv-26"]
    rows = eval_extract.read_log(eval_extract.log_path_of(mem, out, "conv-26", cfg.turns_per_add))
    assert [(r["session"], r["chunk"], r["turns"]) for r in rows] == [(s, c, n) for s in (1, 2)
                                                                        for c, n in ((0, 8), (1, 8), (2, 4))]
    plain = mem.count(user_id=eval_extract.user_of(mem, "conv-26", 8, reconcile=False))
    reconciled = mem.count(user_id=eval_extract.user_of(mem, "conv-26", 8))
    extracted_facts = {" ".join(f.split()) for r in rows for f in r["facts"]}  # as the store tells texts apart
    # All added: every distinct extracted fact once (a text is stored once per user).
    assert plain == len(extracted_facts) == conv["growth"][-1]["all_added"]
    assert reconciled == conv["growth"][-1]["reconciled"] <= plain
    assert [g["turns"] for g in conv["growth"]] == [20, 40]  # the third session is left out
    data = locomo.load(locomo_path)[0]
    assert [g["observations"] for g in conv["growth"]] == [
        sum(1 for o in locomo.observations(data) if o.session <= n) for n in (1, 2)]
    assert sum(conv["events"].values()) <= conv["extracted"] == sum(len(r["facts"]) for r in rows)


def test_scores_are_shares_and_the_report_holds_no_conversation_text(mem, extracted, tmp_path, locomo_path):
    cfg, _, result = extracted
    for session in result["conversations"]["conv-26"]["sessions"]:
        for key, value in session.items():
            if "@" in key:
                assert math.isnan(value) or 0 <= value <= 1, (key, value)
    print(eval_extract.report(result, tmp_path, "x"))
    written = (tmp_path / "x.json").read_text()
    assert json.loads(written)["overall"]["sessions"] == 2
    turns = [t["text"] for _, ts, _ in locomo.sessions(locomo.load(locomo_path)[0]) for t in ts]
    assert not any(t in written for t in turns)  # numbers only: LoCoMo's words stay in the home


def test_a_second_run_resumes_without_asking_the_model(mem, extracted, monkeypatch):
    cfg, out, result = extracted

    def refuse(*args, **kwargs):
        raise AssertionError("the model was asked again")

    monkeypatch.setattr(mem.inferrer, "extract", refuse)
    assert eval_extract.run(mem, cfg, out)["conversations"] == result["conversations"]


def test_a_store_without_its_log_is_refused(mem, extracted, tmp_path):
    cfg, _, _ = extracted
    with pytest.raises(InvalidInputError, match="already holds facts") as e:
        eval_extract.run(mem, cfg, tmp_path)  # a fresh log folder, the same users
    assert e.value.param == "conversations"


def test_match_against_itself_is_perfect_and_against_nothing_nan(mem):
    texts = ["Ana adopted a grey cat called Pico.", "Ben ran a half marathon in Lisbon."]
    same = eval_extract.match(mem.embedder, texts, texts, "facts", (0.5, 0.9))
    assert all(v == 1.0 for v in same.values())
    other = eval_extract.match(mem.embedder, texts[:1], texts[1:], "facts", (0.9,))
    assert other == {"facts_precision@0.9": 0.0, "facts_recall@0.9": 0.0}
    assert all(math.isnan(v) for v in eval_extract.match(mem.embedder, [], texts, "facts", (0.5,)).values())
    sim = mem.embedder.embed(texts[:1]) @ mem.embedder.embed(texts[1:]).T
    at = float(sim[0, 0])  # a threshold at the pair's own similarity counts it, just above does not
    assert eval_extract.match(mem.embedder, texts[:1], texts[1:], "f", (at,))["f_recall@" + str(at)] == 1.0
    assert eval_extract.match(mem.embedder, texts[:1], texts[1:], "f", (np.nextafter(at, 1),))[
        "f_recall@" + str(np.nextafter(at, 1))] == 0.0


def test_locomo_eval_answers_from_the_extracted_memory(mem, extracted, locomo_path):
    """eval locomo --memory extracted reads eval extract's reconciled user (built already here, so
    the model is asked only to answer)."""
    cfg, out, _ = extracted
    ecfg = eval_locomo.EvalConfig(locomo_path, ("conv-26",), k=3, memory="extracted", limit=2)
    assert ecfg.memory_name == "extracted-t8" and ecfg.window_size == 0
    rows = eval_locomo.run(mem, ecfg, out)
    assert len(rows) == 2 and all(r["fact_ids"] for r in rows)
    user = eval_extract.user_of(mem, "conv-26", 8)
    stored = {f.id for f in mem.get_all(user_id=user, limit=1000)}
    assert all(set(r["fact_ids"]) <= stored for r in rows)
    assert all(r["recall"] is None or 0 <= r["recall"] <= 1 for r in rows)


@pytest.mark.parametrize("bad, param", [({"turns_per_add": 0}, "turns_per_add"), ({"threshold": 1.5}, "threshold"),
                                        ({"sessions": 0}, "sessions")])
def test_bad_settings_are_refused(locomo_path, bad, param):
    with pytest.raises(InvalidInputError) as e:
        ExtractEvalConfig(locomo_path, **bad)
    assert e.value.param == param


def test_extracted_memory_takes_no_window(locomo_path):
    with pytest.raises(InvalidInputError) as e:
        eval_locomo.EvalConfig(locomo_path, memory="extracted", window=2)
    assert e.value.param == "window"
