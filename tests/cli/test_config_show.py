"""`kvmem config show`: every setting with its value and its source, as a table or JSON."""

from __future__ import annotations

import json
import os

import pytest

from kvmem.cli import main


@pytest.fixture
def show(monkeypatch, capsys):
    """show(*args) -> (exit code, stdout, stderr) of `kvmem *args`, with KVMEM_* variables cleared."""
    for name in [n for n in os.environ if n.startswith("KVMEM_")]:
        monkeypatch.delenv(name)

    def run(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        rc = main(list(args))
        out, err = capsys.readouterr()
        return rc, out, err

    return run


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "kvmem.toml"
    path.write_text('[engine]\nmax_model_len = 2048\nmodel = "from-file"\n[kv]\ncodec = "int8"\n')
    return path


def test_a_value_set_by_file_env_and_flag_shows_each_source(show, config_file, monkeypatch, tmp_path):
    monkeypatch.setenv("KVMEM_RETRIEVAL", "dense")
    monkeypatch.setenv("KVMEM_KV_CODEC", "k7v8")  # over the file's int8
    rc, out, _ = show("--config", str(config_file), "config", "show", "--json", "--model", "gemma3-270m",
                      "--home", str(tmp_path / "h"))
    assert rc == 0
    rows = json.loads(out)
    assert rows["engine.max_model_len"] == {"value": 2048, "source": "file", "from": f"{config_file} [engine]"}
    assert rows["retrieval.mode"] == {"value": "dense", "source": "env", "from": "KVMEM_RETRIEVAL"}
    assert rows["kv.codec"] == {"value": "k7v8", "source": "env", "from": "KVMEM_KV_CODEC"}
    assert rows["engine.model"] == {"value": "gemma3-270m", "source": "flag", "from": "--model"}
    assert rows["home"] == {"value": str(tmp_path / "h"), "source": "flag", "from": "--home"}
    assert rows["engine.block_size"] == {"value": 32, "source": "default", "from": ""}
    assert rows["kv_root"] == {"value": None, "source": "default", "from": ""}


def test_the_table_has_one_line_per_setting_with_its_source(show, config_file, monkeypatch):
    monkeypatch.setenv("KVMEM_RETRIEVAL", "lexical")
    rc, out, _ = show("config", "show", "--config", str(config_file), "--model", "gemma3-270m")
    assert rc == 0
    header, *lines = out.splitlines()
    assert header.split() == ["key", "value", "source"]
    table = {line.split()[0]: line.split(None, 2)[1:] for line in lines}
    assert table["engine.max_model_len"] == ["2048", f"file {config_file} [engine]"]
    assert table["retrieval.mode"] == ['"lexical"', "env KVMEM_RETRIEVAL"]
    assert table["engine.model"] == ['"gemma3-270m"', "flag --model"]
    assert table["memory.window"] == ["2", "default"]
    assert table["engine.url"] == ["null", "default"]


def test_without_the_flag_the_env_then_the_file_value_shows(show, config_file, monkeypatch):
    def model():
        rc, out, _ = show("--config", str(config_file), "config", "show", "--json")
        assert rc == 0
        return json.loads(out)["engine.model"]

    monkeypatch.setenv("KVMEM_MODEL", "from-env")
    assert model() == {"value": "from-env", "source": "env", "from": "KVMEM_MODEL"}
    monkeypatch.delenv("KVMEM_MODEL")
    assert model() == {"value": "from-file", "source": "file", "from": f"{config_file} [engine]"}


def test_a_bad_setting_is_an_error_naming_it_not_a_traceback(show, tmp_path, monkeypatch):
    bad = tmp_path / "bad.toml"
    bad.write_text("[engine]\nmax_model_lenght = 1\n")
    rc, _, err = show("--config", str(bad), "config", "show")
    assert rc == 1 and err.startswith("kvmem: [engine]: unknown settings ['max_model_lenght']")
    monkeypatch.setenv("KVMEM_RETRIEVAL_DEPTH", "deep")
    rc, _, err = show("config", "show")
    assert rc == 1 and "KVMEM_RETRIEVAL_DEPTH='deep'" in err
