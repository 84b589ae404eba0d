"""`kvmem serve` settings go through the same overlay as every command: defaults < config file <
KVMEM_* variables < flags, for the server's own settings as for kvmem's."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmem.server.settings import SettingsError, load, load_resolved


@pytest.fixture
def toml(tmp_path):
    path = tmp_path / "server.toml"
    path.write_text('home = "/from-file"\n[server]\nmax_inflight = 3\nmax_body_bytes = 7\n'
                    '[tenants]\nacme = "k1"\n[engine]\nmax_model_len = 1024\n[retrieval]\ndepth = 9\n')
    return path


def test_env_wins_over_the_file_and_flags_over_both(toml):
    env = {"KVMEM_SERVER_MAX_INFLIGHT": "5", "KVMEM_MAX_MODEL_LEN": "2048", "KVMEM_HOME": "/from-env"}
    settings, config = load(toml, env, {})
    assert (settings.max_inflight, settings.max_body_bytes) == (5, 7)
    assert (config.engine.max_model_len, config.retrieval.depth, config.home) == (2048, 9, Path("/from-env"))
    settings, config = load(toml, env, {"max_inflight": 8, "home": Path("/from-flag"), "verbose": False})
    assert (settings.max_inflight, config.home) == (8, Path("/from-flag"))
    settings, config = load(toml, {}, {})
    assert (settings.max_inflight, config.engine.max_model_len, config.home) == (3, 1024, Path("/from-file"))


def test_keys_are_merged_from_file_and_env_and_sources_are_kept(toml):
    settings, resolved = load_resolved(toml, {"KVMEM_API_KEYS": "globex=k2"}, {"model": "gemma3-270m"})
    assert settings.api_keys == {"k1": "acme", "k2": "globex"}
    assert (resolved.sources["engine.model"].kind, resolved.sources["retrieval.depth"].kind) == ("flag", "file")


@pytest.mark.parametrize("text,message", [
    ("[server]\nmax_inflihgt = 3\n", "max_inflihgt"),
    ("[engine]\nmodle = 'x'\n", "modle"),
    ("[nope]\n", "unknown sections"),
    ("server = 1\n", "must be a table"),
])
def test_every_bad_file_is_a_settings_error(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(SettingsError, match=message):
        load(path, {}, {})


def test_a_bad_variable_is_a_settings_error_too():
    with pytest.raises(SettingsError, match="KVMEM_MAX_MODEL_LEN"):
        load(None, {"KVMEM_MAX_MODEL_LEN": "x"}, {})
