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
