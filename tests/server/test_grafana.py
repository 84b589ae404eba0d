"""docs/grafana/kvmem-dashboard.json: every kvmem metric it plots is one the real server exposes,
and every vLLM metric one vLLM 0.32 defines (a renamed metric would leave a panel empty)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import vllm

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "kvmem-dashboard.json"


def _exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p["targets"]]


def test_every_panel_has_a_query():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and len(dash["panels"]) >= 10
    assert all(p["targets"] and p["title"] for p in dash["panels"])


def test_kvmem_metrics_are_the_servers(alpha):
    alpha.post("/v1/chat/completions", json={"model": "kvmem", "max_tokens": 1,
                                             "messages": [{"role": "user", "content": "hi"}]})
    # A labelled counter nobody has counted yet has only its HELP and TYPE lines: names come from those.
    exposed = {_base(line.split()[2]) for line in alpha.get("/metrics").text.splitlines() if line.startswith("# TYPE")}
    used = {_base(m) for e in _exprs() for m in re.findall(r"\bkvmem_[a-z_]+", e)}
    assert used and used <= exposed, used - exposed


def _base(name: str) -> str:
    return re.sub(r"_(total|bucket|count|sum|created)$", "", name)


def test_vllm_metrics_are_vllms():
    source = "".join(p.read_text() for p in (Path(vllm.__file__).parent / "v1" / "metrics").glob("*.py"))
    used = {m for e in _exprs() for m in re.findall(r"vllm:[a-z_]+", e)}
    missing = {m for m in used if f'"{m.removesuffix("_total")}"' not in source}
    assert used and not missing, missing
