import math

import pytest

from kvmem.bench.metrics import bootstrap_ci, locomo_f1, ratio_ci, token_f1, top20_kl


def test_token_f1_normalises_case_punctuation_and_articles():
    assert token_f1("The Eiffel Tower!", "eiffel tower") == 1.0
    assert token_f1("a red car", "blue car") == 0.5
    assert token_f1("", "anything") == 0.0


def test_multi_hop_gold_parts_are_scored_separately():
    assert locomo_f1("painting, swimming", "swimming, painting", 1) == 1.0
    assert locomo_f1("painting", "swimming, painting", 1) == 0.5


def test_open_domain_gold_uses_the_part_before_a_semicolon():
    assert locomo_f1("likely yes", "likely yes; because she said so", 3) == 1.0


def test_kl_is_zero_for_identical_and_positive_otherwise():
    a = {1: math.log(0.7), 2: math.log(0.3)}
    assert top20_kl(a, a) == 0.0
    assert top20_kl(a, {1: math.log(0.3), 2: math.log(0.7)}) > 0


def test_bootstrap_interval_contains_the_mean():
    mean, lo, hi = bootstrap_ci([0.0, 1.0] * 50)
    assert lo <= mean <= hi and mean == 0.5 and hi - lo < 0.3


def test_ratio_interval_of_a_constant_ratio_is_tight():
    point, lo, hi = ratio_ci([0.5, 1.0, 1.5], [1.0, 2.0, 3.0])
    assert point == lo == hi == 0.5


def test_eval_report_writes_json_and_markdown(tmp_path):
    from pathlib import Path

    from kvmem.bench.eval_locomo import EvalConfig
    from kvmem.bench.eval_report import write

    def mode(f1, ll):
        return {"f1": f1, "ll": ll}

    rows = [{"category": c, "recall": 0.5, "top1_agree": True, "kl_text_kv": 0.1,
             "text": mode(0.5, -1.0), "kv": mode(0.4, -1.5), "off": mode(0.1, -3.0)} for c in (1, 2)]
    cfg = EvalConfig(Path("data.json"), k=3, limit=2)
    table = write(rows, cfg, tmp_path / "out")
    saved = __import__("json").loads((tmp_path / "out" / f"{cfg.name}.json").read_text())
    assert saved["summary"]["overall"]["n"] == 2 and saved["config"]["data"] == "data.json"
    assert saved["summary"]["overall"]["ll_retention_kv"][0] == 0.75  # (−1.5+3)/(−1+3)
    assert abs(saved["summary"]["overall"]["f1_retention_kv"][0] - 0.75) < 1e-9  # (0.4−0.1)/(0.5−0.1)
    assert (tmp_path / "out" / f"{cfg.name}.md").read_text() == table + "\n" and "category 2" in table


def test_median_ratio_interval_brackets_the_ratio_and_pairs_repetitions():
    from kvmem.bench.metrics import median_ratio_ci

    text = [1.0, 1.2, 0.9, 1.1, 1.0, 5.0, 1.05]
    kv = [0.1, 0.12, 0.09, 0.11, 0.1, 0.5, 0.105]  # exactly 10x in every repetition
    point, lo, hi = median_ratio_ci(text, kv, paired=True)
    assert abs(point - 10) < 1e-9 and abs(lo - 10) < 1e-9 and abs(hi - 10) < 1e-9
    point, lo, hi = median_ratio_ci(text, kv, paired=False)  # unpaired: the spread shows
    assert lo < 10 < hi
    with pytest.raises(ValueError):
        median_ratio_ci([1.0], [1.0, 2.0], paired=True)


def test_eval_report_puts_kv_without_the_reader_adapter_beside_kv_with_it():
    from kvmem.bench.eval_report import markdown, summarize

    def mode(f1, ll):
        return {"f1": f1, "ll": ll}

    rows = [{"category": 1, "recall": 1.0, "top1_agree": True, "kl_text_kv": 0.05, "top1_agree_plain": False,
             "kl_text_kv_plain": 0.2, "text": mode(0.5, -1.0), "kv": mode(0.5, -1.0), "kv_plain": mode(0.3, -2.0),
             "off": mode(0.1, -3.0)}] * 3
    overall = summarize(rows)["overall"]
    assert overall["f1_retention_kv"][0] == 1.0 and abs(overall["f1_retention_kv_plain"][0] - 0.5) < 1e-9
    assert overall["ll_retention_kv_plain"][0] == 0.5 and overall["top1_agree_plain"][0] == 0.0
    assert "KV mode without the reader adapter" in markdown(summarize(rows), "t")
    assert "without the reader adapter" not in markdown(summarize([{k: v for k, v in rows[0].items()
                                                                     if "plain" not in k}]), "t")


def test_eval_report_puts_each_codec_beside_the_lossless_blobs():
    from kvmem.bench.eval_report import markdown, summarize

    def mode(f1, ll):
        return {"f1": f1, "ll": ll}

    rows = [{"category": 1, "recall": 1.0, "top1_agree": True, "kl_text_kv": 0.05, "top1_agree_int6": False,
             "kl_text_kv_int6": 0.3, "top1_agree_lossless_int6": True, "text": mode(0.5, -1.0), "kv": mode(0.5, -1.0), "kv_int6": mode(0.2, -2.5),
             "off": mode(0.1, -3.0)}] * 3
    overall = summarize(rows)["overall"]
    assert abs(overall["f1_retention_kv_int6"][0] - 0.25) < 1e-9 and overall["ll_retention_kv_int6"][0] == 0.25
    assert overall["top1_agree_int6"][0] == 0.0 and overall["kl_text_kv_int6"][0] == 0.3
    assert overall["top1_agree_lossless_int6"][0] == 1.0
    table = markdown(summarize(rows), "t")
    assert "| int6 | 0.200" in table and "| none | 0.500" in table
    assert "per codec" not in markdown(summarize([{k: v for k, v in rows[0].items() if "int6" not in k}]), "t")
