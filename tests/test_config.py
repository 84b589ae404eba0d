"""Config.from_env: defaults, then KVMEM_* variables, then explicit overrides; and the commands'
overlay (config_overlay.resolve): defaults < config file < environment < flags, with sources."""

from pathlib import Path

import pytest

from kvmem.config import Config, ConfigError, KVConfig, RetrievalConfig, flatten, keys
from kvmem.config_overlay import ConfigFile, Source, resolve


def test_retrieval_comes_from_the_environment(monkeypatch):
    assert Config.from_env().retrieval == RetrievalConfig()
    monkeypatch.setenv("KVMEM_RETRIEVAL", "dense")
    monkeypatch.setenv("KVMEM_RETRIEVAL_DEPTH", "30")
    monkeypatch.setenv("KVMEM_RETRIEVAL_DENSE_WEIGHT", "0.7")
    assert Config.from_env().retrieval == RetrievalConfig(mode="dense", depth=30, dense_weight=0.7)
    explicit = RetrievalConfig(depth=7)
    assert Config.from_env(retrieval=explicit).retrieval is explicit


@pytest.mark.parametrize("name,value,message", [
    ("KVMEM_RETRIEVAL", "fuzzy", "retrieval mode must be one of"),
    ("KVMEM_RETRIEVAL_DEPTH", "0", "depth must be >= 1"),
    ("KVMEM_RETRIEVAL_DENSE_WEIGHT", "1.5", "dense_weight within"),
    ("KVMEM_RETRIEVAL_DEPTH", "many", "invalid literal"),
])
def test_a_bad_retrieval_setting_is_refused(monkeypatch, name, value, message):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        Config.from_env()


def test_kv_text_facts_comes_from_the_environment_and_must_be_a_count(monkeypatch):
    assert Config.from_env().kv.text_facts == 0
    monkeypatch.setenv("KVMEM_KV_TEXT_FACTS", "2")
    assert Config.from_env().kv.text_facts == 2
    for bad in ("-1", "two"):
        monkeypatch.setenv("KVMEM_KV_TEXT_FACTS", bad)
        with pytest.raises(ValueError, match="text_facts must be an int >= 0|invalid literal"):
            Config.from_env()
    with pytest.raises(ValueError, match="text_facts must be an int >= 0"):
        KVConfig(text_facts=True)  # as the service refuses it per chat


def test_kv_text_facts_rule_comes_from_the_environment_and_names_its_choices(monkeypatch):
    assert Config.from_env().kv.text_facts_rule == "last"
    monkeypatch.setenv("KVMEM_KV_TEXT_FACTS_RULE", "relevant")
    assert Config.from_env().kv.text_facts_rule == "relevant"
    monkeypatch.setenv("KVMEM_KV_TEXT_FACTS_RULE", "best")
    with pytest.raises(ValueError, match="text_facts_rule must be 'last' or 'relevant'"):
        Config.from_env()


def test_kv_fidelity_names_a_point_that_sets_recompute_and_text_facts(monkeypatch):
    from kvmem.kv.fidelity import POINTS
    from kvmem.kv.recompute import Recompute

    plain = KVConfig()
    assert plain.fidelity is None and plain.recompute_setting == Recompute(0.0) and plain.text_facts_setting == 0
    monkeypatch.setenv("KVMEM_KV_FIDELITY", "exact")
    exact = Config.from_env().kv
    assert exact.recompute_setting == Recompute(1.0, "first") == POINTS["exact"].recompute
    assert KVConfig(fidelity="balanced").recompute_setting.on is False
    assert KVConfig(fidelity="balanced").text_facts_setting == 4
    assert KVConfig(fidelity="fast").recompute_setting.on is False
    with pytest.raises(ValueError, match="fidelity must be one of"):
        KVConfig(fidelity="best")
    for given in (dict(recompute=0.3), dict(text_facts=2), dict(recompute_rule="first")):
        with pytest.raises(ValueError, match="set the point or those, not both"):
            KVConfig(fidelity="exact", **given)


def test_a_chat_takes_a_fidelity_point_or_its_parts_not_both():
    from kvmem.chat import ChatArgs
    from kvmem.errors import InvalidInputError
    from kvmem.kv.recompute import Recompute

    ChatArgs("u", fidelity="balanced").check()
    with pytest.raises(InvalidInputError, match="fidelity must be one of") as e:
        ChatArgs("u", fidelity="precise").check()
    assert e.value.param == "fidelity"
    for given in (dict(text_facts=1), dict(recompute=Recompute(0.5, "first"))):
        with pytest.raises(InvalidInputError, match="give one or the others"):
            ChatArgs("u", fidelity="exact", **given).check()


# -- the overlay every command builds its Config with (kvmem/config_overlay.py) -------------------


def _file(tmp_path, text: str) -> ConfigFile:
    path = tmp_path / "kvmem.toml"
    path.write_text(text)
    return ConfigFile.read(path)


def test_each_layer_overrides_the_one_below_key_by_key_and_says_so(tmp_path):
    file = _file(tmp_path, 'home = "/f"\n[engine]\nmodel = "file-model"\nmax_model_len = 1024\n'
                           '[retrieval]\ndepth = 7\n')
    env = {"KVMEM_MODEL": "env-model", "KVMEM_HOME": "/e", "KVMEM_MAX_MODEL_LEN": "2048"}
    flags = {"model": "flag-model", "command": "add", "user": "alice"}  # not every dest is configuration
    r = resolve(file=file, env=env, flags=flags)
    assert (r.config.engine.model, r.sources["engine.model"]) == ("flag-model", Source("flag", "--model"))
    assert (r.config.home, r.sources["home"]) == (Path("/e"), Source("env", "KVMEM_HOME"))
    assert (r.config.engine.max_model_len, r.sources["engine.max_model_len"].kind) == (2048, "env")
    assert (r.config.retrieval.depth, r.sources["retrieval.depth"]) == (7, Source("file", f"{file.path} [retrieval]"))
    assert (r.config.engine.block_size, r.sources["engine.block_size"]) == (32, Source("default"))
    assert resolve(file=file, env={}, flags={}).config.engine.model == "file-model"
    assert resolve(file=file, env={}, flags={}).config.home == Path("/f")
    assert resolve(env={}).config.engine.model is None


def test_every_setting_has_a_source_and_the_rows_follow_config_order(tmp_path):
    r = resolve(env={})
    assert [key for key, _, _ in r.rows()] == list(keys()) and set(r.sources) == set(keys())
    assert {source.kind for _, _, source in r.rows()} == {"default"}
    assert Config.from_values(flatten(r.config)) == r.config


def test_models_default_to_the_environments_home_not_the_flags(tmp_path):
    """Converted models are shared by every --home: a throw-away one does not convert again."""
    r = resolve(env={"KVMEM_HOME": str(tmp_path / "env-home")}, flags={"home": tmp_path / "run"})
    assert r.config.home == tmp_path / "run"
    assert (r.config.models_home, r.sources["models_home"].kind) == (tmp_path / "env-home" / "models", "default")
    assert resolve(env={}).config.models_home == Path.home() / ".cache" / "kvmem" / "models"
    assert resolve(env={}, flags={"models_home": "/m"}).config.models_home == Path("/m")
    assert Config.from_env().models_home is None  # the Python API keeps home/models


def test_empty_flags_and_blank_variables_are_not_given(tmp_path):
    file = _file(tmp_path, '[engine]\nmodel = "file-model"\nurl = "http://r:1"\n')
    r = resolve(file=file, env={"KVMEM_MODEL": "", "KVMEM_ENGINE_URL": ""}, flags={"model": "", "home": None})
    assert (r.config.engine.model, r.config.engine.url) == ("file-model", "http://r:1")
    assert r.sources["home"].kind == "default"


def test_gateway_and_serve_flags_reach_their_settings():
    flags = {"replicas": "http://a:1,http://b:2", "database_url": "postgresql://db/k", "kv_shared_url": "redis://c",
             "data_dir": Path("/old"), "text_facts": 0}
    r = resolve(env={"KVMEM_ENGINE_URL": "http://env:1"}, flags=flags)
    assert r.config.engine.url == "http://a:1,http://b:2" and r.sources["engine.url"] == Source("flag", "--replicas")
    assert (r.config.database_url, r.config.kv.shared_url) == ("postgresql://db/k", "redis://c")
    assert r.config.home == Path("/old") and r.sources["home"] == Source("flag", "--data-dir")
    assert r.sources["kv.text_facts"] == Source("flag", "--text-facts")  # 0 is given, not "unset"


def test_a_servers_config_file_reads_its_data_dir_as_home(tmp_path):
    file = _file(tmp_path, '[server]\ndata_dir = "/srv/data"\nport = 9\n[tenants]\nacme = "k"\n')
    r = resolve(file=file, env={})
    assert r.config.home == Path("/srv/data") and r.sources["home"].detail.endswith("[server] data_dir")


@pytest.mark.parametrize("text,message", [
    ("[engin]\nmodel = 'x'\n", "unknown sections \\['engin'\\]"),
    ("[engine]\nmodle = 'x'\n", "\\[engine\\]: unknown settings \\['modle'\\]"),
    ("engine = 3\n", "\\[engine\\] must be a table"),
    ("[kv]\ncodec = 'int3'\n", "codec"),
    ("[engine\n", "is not valid TOML"),
])
def test_a_bad_config_file_is_refused_with_what_is_wrong(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        resolve(file=_file(tmp_path, text), env={})


def test_a_missing_config_file_and_a_bad_variable_name_themselves(tmp_path):
    with pytest.raises(ConfigError, match="cannot read --config"):
        ConfigFile.read(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="KVMEM_MAX_MODEL_LEN='long': invalid literal"):
        resolve(env={"KVMEM_MAX_MODEL_LEN": "long"})
