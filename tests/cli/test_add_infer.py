"""`kvmem add --infer`: the flags it refuses (no engine); run against an endpoint in tests/server/test_infer.py."""

from __future__ import annotations

import pytest

from kvmem.cli import build_parser, main
from kvmem.cli.memory import _check_add
from kvmem.config import default_home
from kvmem.errors import InvalidInputError


@pytest.mark.parametrize("argv", [
    ["--infer", "--timestamp", "2024-01-01", "a fact"],
    ["--infer", "--origin", "said", "a fact"],
    ["--infer", "--messages", "m.json", "--window", "1"],
])
def test_infer_refuses_the_flags_of_facts_given_as_they_are(argv):
    with pytest.raises(InvalidInputError) as e:
        _check_add(build_parser().parse_args(["add", "--user", "u", *argv]))
    assert e.value.param in ("--infer", "--window", "--timestamp", "--origin")


def test_infer_without_an_engine_needs_an_endpoint(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("KVMEM_EXTRACT_URL", raising=False)
    rc = main(["--home", str(tmp_path / "home"), "--models-home", str(default_home() / "models"),
               "add", "--user", "u", "--no-encode", "--infer", "I keep bees."])
    assert rc == 1 and "[extract] url" in capsys.readouterr().err
