"""Every example in README.md, docs/server.md and docs/agents.md marked `<!-- test -->` runs, in order, against the test server."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.server.serverproc import KEYS

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "server.md"
BLOCKS = [b for doc in (ROOT / "README.md", DOC, ROOT / "docs" / "agents.md")
          for b in re.findall(r"<!-- test -->\n```(bash|python)\n(.*?)```", doc.read_text(), re.S)]
DOC_URL = "http://127.0.0.1:8000"


def test_the_doc_has_curl_and_openai_examples():
    assert {lang for lang, _ in BLOCKS} == {"bash", "python"}
    assert any("curl" in code for _, code in BLOCKS) and any("from openai import" in c for _, c in BLOCKS)


@pytest.mark.parametrize("lang,code", BLOCKS, ids=[f"{lang}-{i}" for i, (lang, _) in enumerate(BLOCKS)])
def test_doc_example(server, monkeypatch, capsys, lang, code):
    code = code.replace(DOC_URL, server.url)
    monkeypatch.setenv("KVMEM_API_KEY", KEYS["alpha"])
    if lang == "python":
        exec(compile(code, str(DOC), "exec"), {"__name__": "__doc_example__"})
        out = capsys.readouterr().out
        assert "f-" in out and out.strip()
        return
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", code], capture_output=True, text=True, timeout=300,
                       env=os.environ.copy())
    assert r.returncode == 0, r.stderr
    assert '"error"' not in r.stdout, r.stdout
    assert r.stdout.strip()
