"""docs/configuration.md is scripts/config_doc.py's output: a key added to a config class (or a
flag, a variable, a default changed) without regenerating the page fails here."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _generator():
    spec = importlib.util.spec_from_file_location("config_doc", ROOT / "scripts" / "config_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configuration_page_matches_the_config_classes():
    gen = _generator()
    committed = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert committed == gen.render(), f"docs/configuration.md is out of date: run `{gen.COMMAND}`"


def test_every_setting_has_a_row():
    from kvmem.config import keys

    page = _generator().render()
    for key in keys():
        section, _, name = key.rpartition(".")
        assert (f"`[{section}] {name}`" if section else f"`{name}`") in page, key
