"""Config.from_env: defaults, then KVMEM_* variables, then explicit overrides."""

import pytest

from kvmem.config import Config, KVConfig, RetrievalConfig


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
