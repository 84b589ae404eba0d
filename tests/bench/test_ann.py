"""`kvmem bench ann` on tiny data: every column is filled and the graph finds the true neighbours."""

from __future__ import annotations

import json
import math

import pytest

from kvmem.bench import ann


def _check(result: dict, n: int) -> ann.AnnResult:
    rows = {r["name"]: ann.AnnResult(**r) for r in result["results"]}
    graph = rows["kvmem-graph"]
    assert result["config"]["n"] == n and graph.build_s > 0
    assert max(s["recall"] for s in graph.sweep) >= 0.95
    assert graph.qps1 > 0 and graph.qps2 > 0 and graph.insert_batch_vps > 0 and graph.insert_one_vps > 0
    assert graph.recall_after_delete >= 0.9
    exact = next(r for name, r in rows.items() if name.startswith("exact"))
    assert exact.sweep[0]["recall"] == 1.0 and exact.qps2 > 0
    assert graph.bytes_per_vector < 0.6 * exact.bytes_per_vector  # int8 rows + codes + graph vs float32
    return graph


def test_clustered_run_reports_every_column(tmp_path):
    cfg = ann.AnnConfig(n=3000, queries=50, extra=100, centres=30, indexes=("kvmem-graph", "exact"), name="tiny")
    result = ann.run(cfg, log=lambda *a: None)
    _check(result, 3000)
    assert [f["share"] for f in result["filtered"]] == [0.01, 0.1, 0.5]
    # under 2,000 rows pass every filter here: the scan path
    assert all(f["recall"] >= 0.95 and f["qps1"] > 0 and f["path"] == "scan" for f in result["filtered"])
    table = ann.report(result, tmp_path)
    assert "QPS2" in table and "kvmem-graph" in table and "| 50% | scan |" in table
    assert json.loads((tmp_path / "tiny.json").read_text())["config"]["name"] == "tiny"
    assert (tmp_path / "tiny.png").stat().st_size > 0


def test_locomo_data_embeds_turns_as_base_and_questions_as_queries(locomo_path):
    cfg = ann.AnnConfig(data="locomo", locomo=str(locomo_path), indexes=("kvmem-graph", "exact"))
    sized, base, extra, queries = ann.load_data(cfg, log=lambda *a: None)
    assert base.shape[1] == queries.shape[1] == 384 and sized.n == len(base) and sized.extra == len(extra)
    assert math.isclose(float((base * base).sum(1).mean()), 1.0, rel_tol=1e-3)  # MiniLM's unit vectors
    assert len(extra) == (len(base) + len(extra)) // 10 and sized.queries == len(queries) > 0


def test_an_unknown_data_set_is_refused_with_the_projects_error():
    from kvmem.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match="clustered or locomo") as err:
        ann.load_data(ann.AnnConfig(n=100, data="sift"), log=lambda *a: None)
    assert err.value.param == "data"
