"""The command line's InvalidInputError names the flag or argument at fault (param=)."""

from __future__ import annotations

import io

import pytest

from kvmem.cli import build_parser
from kvmem.cli.memory import _check_add, _json_arg, _read_messages
from kvmem.errors import InvalidInputError


@pytest.mark.parametrize("argv,param", [
    (["--user", "u"], "FACT"),  # neither facts nor --messages
    (["--user", "u", "--messages", "m.json", "a fact"], "FACT"),  # both
    (["--user", "u", "--window", "1", "a fact"], "--window"),
    (["--user", "u", "--messages", "m.json", "--timestamp", "2024-01-01"], "--timestamp"),
    (["--user", "u", "--messages", "m.json", "--origin", "said"], "--origin"),
])
def test_add_names_the_flag_that_does_not_fit(argv, param):
    with pytest.raises(InvalidInputError) as e:
        _check_add(build_parser().parse_args(["add", *argv]))
    assert (e.value.param, e.value.code) == (param, InvalidInputError.INVALID_VALUE)


def test_json_flags_and_message_files_name_their_flag(tmp_path, monkeypatch):
    with pytest.raises(InvalidInputError, match="--metadata is not valid JSON") as e:
        _json_arg("--metadata", "{nope", dict)
    assert e.value.param == "--metadata"
    with pytest.raises(InvalidInputError, match="--filters must be a JSON object") as e:
        _json_arg("--filters", "[]", dict)
    assert e.value.param == "--filters"
    with pytest.raises(InvalidInputError, match="cannot read --messages") as e:
        _read_messages(str(tmp_path / "missing.json"))
    assert e.value.param == "--messages"
    monkeypatch.setattr("sys.stdin", io.StringIO('{"turns": []}'))
    with pytest.raises(InvalidInputError, match="--messages stdin: expected a list") as e:
        _read_messages("-")
    assert e.value.param == "--messages"
    monkeypatch.setattr("sys.stdin", io.StringIO("not json"))
    with pytest.raises(InvalidInputError, match="--messages stdin is not valid JSON") as e:
        _read_messages("-")
    assert e.value.param == "--messages"
