"""Tiny configurations of the benchmarks and the evaluation on the real engine: structure and sanity."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from kvmem.bench import eval_locomo, eval_report, load, locomo, noise_floor, oracle, ttft
from kvmem.errors import InvalidInputError


def test_oracle_bench_finds_k1_exact(mem, tmp_path):
    result = oracle.run(mem, user="oracle-bench-test")
    s = result["summary"]
    assert len(result["k1"]) == len(result["k10"]) == 10 and s["k1_fallbacks"] == 0
    assert all(r["injected_tokens"] > 0 for r in result["k1"])
    assert s["k1_max_gap"] <= 2 * s["k1_max_noise"] + 0.05
    assert s["k1_top1_agree"] >= 0.9 and 0 <= s["k10_top1_agree"] <= 1 and s["k10_mean_kl"] >= 0
    assert "k=1 max top-20 logprob gap" in oracle.report(result, tmp_path / "oracle")
    assert json.loads((tmp_path / "oracle.json").read_text())["summary"] == s
    assert mem.get_all(user_id="oracle-bench-test") == []  # it cleans up after itself


def test_ttft_bench_tiny(mem, tmp_path, locomo_path):
    result = ttft.run(mem, data=locomo_path, ks=(0, 5), reps=2)
    text = ttft.report(result, tmp_path / "ttft")
    assert [r["k"] for r in result["rows"]] == [0, 5]
    for row in result["rows"]:
        assert row["ratio_median"] > 0 and row["text"]["n"] == row["kv"]["n"] == row["cached"]["n"] == 2
        assert row["text"]["median"] <= row["text"]["p90"] and row["kv_over_cached"] > 0
        assert row["facts_hit"]["n"] == 2 and row["kv_over_facts_hit"] > 0
        assert 0 < row["ratio_ci"][1] <= row["ratio_median"] <= row["ratio_ci"][2]
    assert result["kv_growth_max_k_over_k0"] > 0 and result["cached_growth_max_k_over_k0"] > 0
    assert result["kv_growth_ci"][0] == result["kv_growth_max_k_over_k0"]
    assert result["rows"][1]["prompt_tokens"] > result["rows"][0]["prompt_tokens"]
    assert (tmp_path / "ttft.png").stat().st_size > 0 and json.loads((tmp_path / "ttft.json").read_text())
    assert "| 5 |" in text and "prefix-cache hit" in text and "kv/facts hit" in text
    assert "kv_all" not in result["rows"][0] and "all injected" not in text


def test_ttft_bench_times_kv_with_its_last_facts_as_text_beside_all_injected(mem, tmp_path, locomo_path, monkeypatch):
    from dataclasses import replace

    config = replace(mem.config, kv=replace(mem.config.kv, text_facts=1))
    monkeypatch.setattr(mem, "config", config)  # what the bench reads
    monkeypatch.setattr(mem.chats, "config", config)  # what the chats are assembled with
    result = ttft.run(mem, data=locomo_path, ks=(5,), reps=2)
    text = ttft.report(result, tmp_path / "ttft")
    (row,) = result["rows"]
    assert result["text_facts"] == 1 and row["kv_all"]["n"] == row["kv"]["n"] == 2
    assert row["text_facts_ratio_share"] == row["ratio_median"] / row["ratio_median_all"] > 0
    assert "last 1 facts as text" in text and "| 5 |" in text.split("all injected")[-1]


def test_ttft_bench_times_fidelity_points_in_the_same_repetitions(mem, tmp_path, locomo_path):
    # seed 1: orders no earlier test of this module chatted (its text-facts blocks would be cached)
    result = ttft.run(mem, data=locomo_path, ks=(5,), reps=2, seed=1, points=("text-facts-1", "first-0.5"))
    text = ttft.report(result, tmp_path / "ttft")
    (row,) = result["rows"]
    facts_as_text, recomputed = row["points"]["text-facts-1"], row["points"]["first-0.5"]
    assert facts_as_text["n"] == recomputed["n"] == row["kv"]["n"] == 2
    assert row["points_reference"] == "kv" and "kv_all" not in row  # the config injects plainly: kv is the reference
    assert recomputed["share"] == row["kv"]["median"] / recomputed["median"]
    # each point did what it names: one fact fewer injected, half of each fact recomputed
    assert 0 < facts_as_text["injected_tokens"] < recomputed["injected_tokens"]
    assert facts_as_text["recomputed_tokens"] == 0 < recomputed["recomputed_tokens"] < recomputed["injected_tokens"]
    assert "| 5 | first-0.5 |" in text and "| 5 | plain injection |" in text
    for bad in (("fast",), ("balanced", "text-facts-4")):  # plain again, or one salt twice
        with pytest.raises(ValueError, match="plain injection|repeats"):
            ttft.run(mem, data=locomo_path, ks=(5,), points=bad)


def test_load_bench_tiny(mem, tmp_path, locomo_path):
    result = load.run(mem, data=locomo_path, levels=(1, 2), k=5, requests=1, max_tokens=4)
    text = load.report(result, tmp_path / "load")
    for row in result["rows"]:
        for mode in ("text", "kv"):
            assert row[mode]["requests"] == row["users"] and row[mode]["errors"] == []
            assert row[mode]["requests_per_s"] > 0 and row[mode]["ttft_p50"] <= row[mode]["ttft_p99"]
        assert row["throughput_ratio"] > 0
        # where KV's time went under load: the connector's stages, from chats that outlived their first step
        kv = row["kv"]
        assert "connector_ms" not in row["text"] and kv.get("connector_reports") == row["users"], kv
        assert kv["connector_ms"]["staging"] > 0 and kv["connector_ms"]["forward"] > 0
        assert 0 < kv["connector_total_ms"] < kv["ttft_p99"] * 1e3 and kv["shared_step_median"] >= 1
        assert f"- {row['users']} users, KV: the connector's work per request" in text
    assert (tmp_path / "load.png").exists()


def test_ttft_and_load_benches_read_the_synthetic_set_kvmem_ships_when_given_no_data(mem, tmp_path):
    result = ttft.run(mem, ks=(0, 2), reps=1)
    assert (result["data"], result["data_path"]) == ("synthetic", str(locomo.SYNTHETIC_PATH))
    assert [r["k"] for r in result["rows"]] == [0, 2] and result["rows"][1]["kv"]["n"] == 1
    text = ttft.report(result, tmp_path / "ttft")
    assert text.startswith("data: the synthetic tuning set kvmem ships") and "| 2 |" in text
    assert json.loads((tmp_path / "ttft.json").read_text())["data"] == "synthetic"
    result = load.run(mem, levels=(1,), k=2, requests=1, max_tokens=2)
    assert result["data"] == "synthetic" and result["rows"][0]["kv"]["errors"] == []
    assert load.report(result, tmp_path / "load").startswith("data: the synthetic tuning set kvmem ships")


def test_ttft_and_load_benches_name_a_missing_data_file_and_never_fall_back(tmp_path):
    from kvmem.bench import cli
    from kvmem.cli import build_parser

    missing = tmp_path / "nowhere" / "locomo_dev.json"
    for bench in (lambda: ttft.run(None, data=missing), lambda: load.run(None, data=missing)):
        with pytest.raises(InvalidInputError, match=str(missing)):
            bench()  # raised before the bench touches its service
    for name in ("ttft", "load"):
        args = build_parser().parse_args(["bench", name, "--out", str(tmp_path)])
        assert args.data is None
        assert cli.bench_data(args, name) == (locomo.SYNTHETIC_PATH, tmp_path / f"{name}-synthetic")
        with pytest.raises(InvalidInputError, match=str(missing)):  # checked before the engine starts
            cli.bench_data(build_parser().parse_args(["bench", name, "--data", str(missing)]), name)
    lo = tmp_path / "locomo.json"
    lo.write_text("[]")
    args = build_parser().parse_args(["bench", "ttft", "--data", str(lo)])
    assert cli.bench_data(args, "ttft") == (lo, cli.RESULTS / "ttft")  # LoCoMo's results keep their names


def test_locomo_eval_tiny_is_sane_and_resumes(mem, tmp_path, locomo_path):
    cfg = eval_locomo.EvalConfig(locomo_path, ("conv-26",), k=3, limit=3, workers=2)
    rows = eval_locomo.run(mem, cfg, tmp_path)
    assert len(rows) == 3
    again = eval_locomo.run(mem, cfg, tmp_path)  # resumes: nothing answered twice
    assert len(again) == 3
    summary = eval_report.summarize(rows)
    overall = summary["overall"]
    assert overall["n"] == 3
    recall = overall["recall_at_k"][0]
    assert math.isnan(recall) or 0.0 <= recall <= 1.0
    for mode in ("text", "kv", "off"):
        assert 0.0 <= overall[f"f1_{mode}"][0] <= 1.0 and overall[f"ll_{mode}"][0] < 0
    assert "overall" in eval_report.markdown(summary, cfg.name)
    # The noise floor: every question answered again in text mode, logged once, resumed.
    second = noise_floor.log_path_of(tmp_path / eval_locomo.log_name(cfg, mem.model.fingerprint, None))
    assert len(second.read_text().splitlines()) == 3
    assert all(isinstance(r["same_answer_text2"], bool) and r["text2"]["first"] for r in again)
    assert 0.0 <= overall["same_answer_noise"][0] <= 1.0 and "same_answer_rel" in overall
    assert "noise floor" in eval_report.markdown(summary, cfg.name)


def test_noise_floor_compares_the_second_text_pass_with_the_first():
    first = {"1": -0.1, "2": -2.5}
    rows = [{"key": "a", "text": {"answer": "Paris", "first": first}},
            {"key": "b", "text": {"answer": "Rome", "first": first}},
            {"key": "c", "text": {"answer": "Oslo", "first": first}}]
    second = {"a": {"answer": "Paris", "f1": 1.0, "first": dict(first)},
              "b": {"answer": "Lima", "f1": 0.0, "first": {"1": -2.5, "2": -0.1}}}
    out = noise_floor.attach(rows, second)
    assert out[0]["same_answer_text2"] and out[0]["top1_agree_text2"] and out[0]["kl_text_text2"] == 0
    assert not out[1]["same_answer_text2"] and not out[1]["top1_agree_text2"] and out[1]["kl_text_text2"] > 0
    assert "text2" not in out[2]  # not answered again yet: the report leaves the noise floor out
    assert noise_floor.workers_for(4) == 1 and noise_floor.workers_for(1) > 1


def test_locomo_eval_never_resumes_from_another_models_log(mem, tmp_path, locomo_path):
    """Two models sharing a home: the second must answer itself and encode the stored facts
    for its own KV (it once took the first model's log as done and served KV mode as text)."""
    cfg = eval_locomo.EvalConfig(locomo_path, ("conv-26",), k=3, limit=2, workers=2, ranking="dense")
    user = eval_locomo.build_memory(mem, locomo.load(locomo_path)[0], cfg, encode=False)
    bogus = "".join(json.dumps({"key": f"conv-26#{i}", "bogus": True}) + "\n" for i in range(50))
    for name in (f"{cfg.name}.jsonl", f"{cfg.name}.{'0' * 12}.jsonl"):  # unkeyed (as logs were), another model's
        (tmp_path / name).write_text(bogus)
    for record in mem.get_all(user_id=user, limit=10_000):  # as if encoded by another model only
        mem.kv.delete(record.id)
        mem.facts.set_kv_status(record.id, "pending")
    rows = eval_locomo.run(mem, cfg, tmp_path)
    assert len(rows) == 2 and not any(r.get("bogus") for r in rows)
    read = {i for r in rows for i in r["fact_ids"]}
    status = {r.id: r.kv_status for r in mem.get_all(user_id=user, limit=10_000)}
    assert read and all(status[i] == "encoded" for i in read)
    # Only what the sampled questions read was encoded: the rest of the conversation waits.
    assert {s for i, s in status.items() if i not in read} == {"pending"}
    assert (tmp_path / f"{cfg.name}.{mem.model.fingerprint[:12]}.jsonl").exists() and cfg.name.endswith("-dense")


def test_locomo_eval_answers_with_each_codec_on_the_same_questions(mem, tmp_path, locomo_path):
    cfg = eval_locomo.EvalConfig(locomo_path, ("conv-26",), k=3, limit=2, workers=2, ranking="dense", codecs=("int4",))
    rows = eval_locomo.run(mem, cfg, tmp_path)
    assert len(rows) == 2 and cfg.name.endswith("-codecs-int4")
    for r in rows:
        assert r["kv_int4"]["ll"] < 0 and r["top1_agree_int4"] in (True, False)
        # The copy served its own re-coded KV: int4's rounding shows against the lossless blobs.
        assert r["kl_text_kv_int4"] != r["kl_text_kv"]
        assert r["top1_agree_lossless_int4"] in (True, False)
    assert "per codec" in eval_report.markdown(eval_report.summarize(rows), cfg.name)


def test_codecs_bench_compares_every_codec_against_the_lossless_blobs(mem, tmp_path, locomo_path):
    from kvmem.bench import codecs

    result = codecs.run(mem, data=locomo_path, prompts=4, k=3)
    rows = result["codecs"]
    assert list(rows) == ["none", "fp8", "int8", "int4", "k8v4", "k4v8", "int7", "int6", "int4h", "k7v8"]
    none = rows["none"]
    assert none["k10_top1_agree_vs_lossless"] == 1.0 and none["k10_mean_kl_vs_lossless"] == 0.0
    # Injected where encoded: the engine's own cache, as exact as its prefix-cache hit (bit for bit
    # on most hosts; on AMX-bf16 hosts a cache hit itself moves the first token's logprobs ~0.1).
    assert none["k1_max_gap"] < 2 * result["k1_cache_noise"] + 0.05
    assert none["bytes_per_token"] == mem.model.kv_bytes_per_token("none")
    assert rows["int4"]["bytes_per_token"] < rows["int8"]["bytes_per_token"] < none["bytes_per_token"] / 1.9
    assert all(0 <= r["k10_top1_agree_vs_text"] <= 1 and r["kv_ttft_median_s"] > 0 for r in rows.values())
    # Each codec really injected its own blobs (no prefix-cache hit on another codec's blocks).
    assert len({r["k10_mean_kl_vs_lossless"] for r in rows.values()}) == len(rows)
    assert "int4" in codecs.report(result, tmp_path / "codecs") and (tmp_path / "codecs.json").exists()
    assert all(mem.get_all(user_id=u) == [] for u in [codecs.USER] + [f"{codecs.USER}-{c}" for c in rows])


def test_locomo_eval_with_both_memories_stores_observations_bare_and_turns_after_their_window(mem, locomo_path):
    conv = locomo.load(locomo_path)[0]
    cfg = eval_locomo.EvalConfig(locomo_path, ("conv-26",), k=3, limit=2, memory="both")
    user = eval_locomo.build_memory(mem, conv, cfg, encode=False)
    records = mem.get_all(user_id=user, limit=10_000)
    observations = [r for r in records if "dia_ids" in r.metadata]
    turns = [r for r in records if "session" in r.metadata]
    assert {r.text for r in observations} == {f"[{o.date}] {o.text}" for o in locomo.observations(conv)}
    assert len(observations) + len(turns) == len(records) and turns
    assert all(not r.context for r in observations)  # observations stand alone, as in "observations"
    assert all(r.context for r in turns if r.position)  # every turn but a session's first has turns before it
    assert user.endswith("-both-w2") and cfg.name.startswith("locomo-both-w2-k3")


def test_locomo_eval_with_both_memories_can_store_observations_after_their_turn(mem, locomo_path):
    conv = locomo.load(locomo_path)[0]
    cfg = eval_locomo.EvalConfig(locomo_path, ("conv-26",), k=3, limit=2, memory="both", observation_window=1)
    user = eval_locomo.build_memory(mem, conv, cfg, encode=False)
    observations = [r for r in mem.get_all(user_id=user, limit=10_000) if "dia_ids" in r.metadata]
    assert observations and all(r.context.count("\n") == 1 for r in observations)  # one turn each
    assert user.endswith("-both-w2-o1") and cfg.name.startswith("locomo-both-w2-o1-k3")
    assert eval_locomo.EvalConfig(locomo_path, memory="both", observation_window=0).name.startswith("locomo-both-w2-k")
    drawn = eval_locomo.EvalConfig(locomo_path, ("conv-26",), k=3, limit=2, observation_origin=True)
    user = eval_locomo.build_memory(mem, conv, drawn, encode=False)
    assert user.endswith("-observations-w0-src") and drawn.name.startswith("locomo-observations-w0-src-k3")
    records = mem.get_all(user_id=user, limit=10_000)
    assert records and all(not r.context and r.origin.count("\n") == 1 for r in records)
    for bad in (dict(memory="observations", observation_window=1), dict(memory="both", observation_window=-1),
                dict(memory="turns", observation_origin=True)):
        with pytest.raises(InvalidInputError):
            eval_locomo.EvalConfig(locomo_path, **bad)


def test_ttft_bench_profile_prints_where_kv_modes_time_goes(mem, tmp_path, locomo_path):
    result = ttft.run(mem, data=locomo_path, ks=(0, 5), reps=2, profile=True)
    text = ttft.report(result, tmp_path / "ttft")
    for row in result["rows"]:
        ms = row["profile"]["connector_ms"]
        assert ms["lookup"] > 0, ms  # every KV chat's plan is checked; at k=0 the head may be a local hit
        if row["k"]:  # facts in random orders are never all cached: they are loaded and placed
            assert all(ms[stage] > 0 for stage in ("plan", "meta", "blob_reads", "staging", "scatter")), ms
            assert ms["forward"] > 0 and ms["handoff"] > 0, ms
    assert result["rows"][1]["profile"]["client_ms"]["retrieval"] > 0
    assert "Where KV mode's time goes" in text and "| blob_reads |" not in text.split("Where")[0]
    assert "| premap (in staging) |" in text and "| handoff | forward |" in text


def test_load_bench_draws_hot_facts_by_zipf_and_reports_the_ram_tiers_hit_rate(mem, tmp_path, locomo_path):
    import random
    from collections import Counter

    ids = [f"f{i}" for i in range(40)]
    rng = random.Random(0)
    draws = [load.pick(rng, ids, 5, 1.2) for _ in range(400)]
    assert all(len(set(d)) == 5 and set(d) <= set(ids) for d in draws)
    seen = Counter(f for d in draws for f in d)
    assert seen["f0"] > 3 * seen.get("f39", 0) and seen["f0"] > seen["f10"]  # the pool's head is hot
    assert sorted(load.pick(random.Random(1), ids, 40, 0.0)) == sorted(ids)  # uniform: a permutation
    result = load.run(mem, data=locomo_path, levels=(2,), k=3, requests=2, max_tokens=2, fact_zipf=1.0)
    (row,) = result["rows"]
    assert result["pool"] == 12 and 0 <= row["kv"]["ram_hit_rate"] <= 1
    assert "RAM-tier hit rate" in load.report(result, tmp_path / "load")


def test_locomo_eval_adds_fidelity_points_to_the_rows_it_logged_and_answers_nothing_again(mem, tmp_path, locomo_path):
    base = eval_locomo.EvalConfig(locomo_path, ("conv-26",), k=3, limit=2, workers=2, noise_floor=False, seed=3)
    first = {r["key"]: r for r in eval_locomo.run(mem, base, tmp_path)}
    with_points = replace(base, points=("text-facts-1", "first-1.0"))
    assert with_points.name == base.name  # the same log: points extend its rows
    rows = eval_locomo.run(mem, with_points, tmp_path)
    assert len(rows) == 2
    for row in rows:
        before = first[row["key"]]
        for mode in ("text", "kv", "off"):
            assert row[mode] == before[mode]  # not answered again: its TTFT too is the first run's
        for point in ("kv@text-facts-1", "kv@first-1.0"):
            assert row[point]["ll"] < 0 and isinstance(row["same_answer@" + point[3:]], bool)
    assert eval_locomo.run(mem, with_points, tmp_path) == rows  # nothing left to add
    log = tmp_path / eval_locomo.log_name(base, mem.model.fingerprint, mem.engine.reader_adapter)
    assert len(log.read_text().splitlines()) == 4  # each question once, then once more with its points
    summary = eval_report.summarize(rows)
    assert eval_report.point_modes(rows) == ["kv@text-facts-1", "kv@first-1.0"]
    assert "f1_retention_kv@first-1.0" in summary["overall"]
    assert "| first-1.0 |" in eval_report.markdown(summary, base.name)
    with pytest.raises(InvalidInputError) as e:
        replace(base, points=("first-2.0",))
    assert e.value.param == "points"
