"""eval locomo's per-question agreement measures and the KV variants it answers with."""

from kvmem.bench.eval_locomo import _tie_aware
from kvmem.bench.eval_report import summarize


def test_tie_aware_agreement_counts_either_of_two_tied_first_tokens():
    tied = {"1": -1.0, "2": -1.002, "3": -3.0}  # within 2^-8 of each other
    clear = {"1": -1.0, "2": -1.5, "3": -3.0}
    picks = {t: {t: -0.1, "9": -2.0} for t in ("1", "2", "3")}
    assert [_tie_aware(tied, picks[t]) for t in ("1", "2", "3")] == [True, True, False]
    assert [_tie_aware(clear, picks[t]) for t in ("1", "2", "3")] == [True, False, False]
    assert _tie_aware({}, picks["1"]) is None


def _row(kv_f1, norc_f1, same):
    mode = lambda f1, answer: {"f1": f1, "ll": -1.0, "answer": answer, "ttft_s": 0.1, "first": {}}  # noqa: E731
    return {"category": 1, "recall": 1.0, "text": mode(0.5, "a"), "off": mode(0.0, "z"), "kv": mode(kv_f1, "a" if same else "b"),
            "kv_norc": mode(norc_f1, "b"), "top1_agree": True, "kl_text_kv": 0.0, "top1_agree_tie": True,
            "same_answer": same, "top1_agree_norc": False, "kl_text_kv_norc": 0.1, "top1_agree_tie_norc": False,
            "same_answer_norc": False}


def test_the_plain_injection_variant_is_summarised_beside_kv_not_as_a_codec():
    summary = summarize([_row(0.5, 0.1, True), _row(0.4, 0.0, False)])["overall"]
    assert summary["same_answer"][0] == 0.5 and summary["same_answer_norc"][0] == 0.0
    assert summary["f1_kv_norc"][0] == 0.05 and "top1_agree_lossless_norc" not in summary
