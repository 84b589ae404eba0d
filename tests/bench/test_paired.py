"""Paired comparison of two eval logs: differences over the shared questions only."""

import json

import pytest

from kvmem.bench import paired


def row(key, f1_text, recall=None):
    return {"key": key, "recall": recall, "text": {"f1": f1_text, "ll": -1.0}, "top1_agree": True}


def test_differences_are_paired_by_question_and_skip_missing_values():
    a = [row("c#0", 0.1, 0.5), row("c#1", 0.2), row("c#2", 0.9, 1.0)]
    b = [row("c#1", 0.5), row("c#0", 0.4, 1.0), row("c#9", 1.0, 1.0)]  # c#9 is not in a
    result = paired.compare(a, b)
    assert result["n"] == 2
    f1 = result["metrics"]["text.f1"]
    assert f1["diff"] == pytest.approx(0.3) and f1["up"] == 2 and f1["down"] == 0
    assert f1["ci"] == pytest.approx([0.3, 0.3])  # both questions moved by 0.3
    assert result["metrics"]["recall"]["n"] == 1  # c#1 has no evidence in a
    assert result["metrics"]["text.ll"]["diff"] == 0 and "kv.f1" not in result["metrics"]


def test_the_command_writes_its_json(tmp_path, capsys):
    for name, rows in (("a", [row("c#0", 0.0), row("c#1", 0.5)]), ("b", [row("c#0", 1.0), row("c#1", 0.0)])):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    paired.main([str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"), str(tmp_path / "out.json")])
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["metrics"]["text.f1"]["up"] == 1 and out["metrics"]["text.f1"]["down"] == 1
    assert "2 questions in both" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        paired.main(["only-one.jsonl"])


def test_plain_compares_kv_without_the_reader_against_kv_with_it_in_one_run(tmp_path, capsys):
    def first(f1, agree, kl):
        return {"f1": f1, "ll": -1.0}, agree, kl

    rows = []
    for i, (plain, reader) in enumerate([(first(0.2, True, 0.3), first(0.5, True, 0.1)),
                                         (first(0.4, True, 0.2), first(0.1, False, 0.1))]):
        rows.append({"key": f"c#{i}", "recall": 1.0, "text": {"f1": 0.3, "ll": -1.0},
                     "kv": reader[0], "top1_agree": reader[1], "kl_text_kv": reader[2],
                     "kv_plain": plain[0], "top1_agree_plain": plain[1], "kl_text_kv_plain": plain[2]})
    (tmp_path / "run.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    paired.main(["--plain", str(tmp_path / "run.jsonl"), str(tmp_path / "out.json")])
    m = json.loads((tmp_path / "out.json").read_text())["metrics"]
    assert m["kv.f1"]["a"] == pytest.approx(0.3) and m["kv.f1"]["b"] == pytest.approx(0.3)
    assert (m["kv.f1"]["up"], m["kv.f1"]["down"]) == (1, 1)
    assert m["top1_agree"]["diff"] == pytest.approx(-0.5) and m["kl_text_kv"]["diff"] == pytest.approx(-0.15)
    assert m["text.f1"]["diff"] == 0  # the same text answers on both sides
    with pytest.raises(SystemExit, match="kv_plain"):
        (tmp_path / "bare.jsonl").write_text(json.dumps(row("c#0", 0.1)) + "\n")
        paired.main(["--plain", str(tmp_path / "bare.jsonl")])
