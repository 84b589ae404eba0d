"""The cluster simulator (kvmem/bench/cluster_sim.py): small runs of the real router whose outcome
could go either way, the cost constants against the results files they cite, and the CLI."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from kvmem.bench import cluster_sim
from kvmem.bench.cluster_sim import COSTS, Scenario, simulate, trace
from kvmem.cli import main

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"
SMALL = Scenario(replicas=4, users_per_replica=10, facts_per_user=40, k=20, seconds=40.0, warmup_s=10.0)
PURE = replace(COSTS.weights(SMALL.k, SMALL.max_tokens), queue_s=0.0)  # residency alone, no load term


def test_one_replica_routes_alike():
    sc = replace(SMALL, replicas=1)
    chats = trace(sc)
    rows = [simulate(sc, policy, chats=chats) for policy in cluster_sim.POLICIES]
    for row in rows:
        row.pop("policy")
    assert rows[0] == rows[1]
    assert rows[0]["timed"] > 50


@pytest.mark.parametrize("change", [{}, {"deaths": 0.25}, {"joins": 0.25}])
def test_every_chat_ends_once(change):
    sc = replace(SMALL, rate_per_replica=3.0, **change)
    chats = trace(sc)
    for policy in cluster_sim.POLICIES:
        row = simulate(sc, policy, chats=chats)
        ended = row["completed_ids"] + row["cut_ids"]
        assert sorted(ended) == [c.id for c in chats], policy  # each once: completed, or cut mid-stream
        assert row["timed"] == sum(c.at >= sc.warmup_s for c in chats)  # each timed chat's first token once
    if "deaths" in change:
        assert row["resent"] + row["cut"] > 0  # the death hit chats in flight: the case above is exercised


def test_deaths_move_only_the_dead_replicas_users_under_rendezvous():
    sc = replace(SMALL, replicas=10, deaths=0.1, seconds=60.0)
    row = simulate(sc, "rendezvous")
    assert row["deaths"] == 1
    assert row["users_moved"] > 0
    assert row["users_moved"] == row["users_moved_off_dead"]
    # and residency, which also weighs load, may move others: it is measured, not assumed alike
    assert simulate(sc, "residency")["users_moved_off_dead"] > 0


def test_pure_residency_keeps_users_on_warm_replicas_when_one_joins():
    """A new, empty replica takes over some users' first choice by rendezvous: they go cold
    there. Residency scoring without the load term keeps them where their KV is."""
    sc = replace(SMALL, replicas=8, joins=0.25, seconds=60.0, rate_per_replica=1.0)
    chats = trace(sc)
    rdv = simulate(sc, "rendezvous", chats=chats)
    res = simulate(sc, "residency", chats=chats, weights=PURE)
    assert rdv["users_moved"] > 0 and res["users_moved"] == 0
    assert res["resident_hit"] > rdv["resident_hit"]


def test_pure_residency_hits_at_least_as_often_on_a_skewed_trace():
    sc = replace(SMALL, replicas=6, user_zipf=1.2, fact_zipf=1.2, deaths=0.2)
    chats = trace(sc)
    rdv = simulate(sc, "rendezvous", chats=chats)
    res = simulate(sc, "residency", chats=chats, weights=PURE)
    assert res["resident_hit"] >= rdv["resident_hit"]


def test_load_term_spreads_a_user_hotter_than_one_replica():
    """Zipf(1.0) over 50 users: the hottest sends ~22% of the chats, more than one replica of 10
    serves; rendezvous queues them all on one, residency spreads them and pays pulls."""
    sc = replace(SMALL, replicas=10, users_per_replica=5, seconds=40.0)
    chats = trace(sc)
    rdv = simulate(sc, "rendezvous", chats=chats)
    res = simulate(sc, "residency", chats=chats)
    assert res["ttft_p99"] < rdv["ttft_p99"] / 2
    assert res["load_max_over_mean"] < rdv["load_max_over_mean"]
    assert res["pulls_per_chat"] > rdv["pulls_per_chat"]


def test_seeded():
    a, b = simulate(SMALL, "residency"), simulate(SMALL, "residency")
    assert a == b
    other = simulate(replace(SMALL, seed=1), "residency")
    assert other["chats"] != a["chats"] and other["resident_hit"] != a["resident_hit"]


def test_a_scenario_with_nothing_timed_is_refused_by_the_cli(capsys):
    assert main(["bench", "cluster", "--seconds", "10", "--warmup", "10"]) == 1
    assert "warmup_s" in capsys.readouterr().err


def _row(name: str, **match) -> dict:
    rows = json.loads((RESULTS / name).read_text())["rows"]
    return next(r for r in rows if all(r[k] == v for k, v in match.items()))


def test_costs_are_the_cited_measurements():
    fast0, fast50 = _row("ttft-fidelity-fast.json", k=0), _row("ttft-fidelity-fast.json", k=50)
    tiers = json.loads((RESULTS / "tier-costs.json").read_text())
    load1, load16 = _row("load.json", users=1)["kv"], _row("load.json", users=16)["kv"]
    load = json.loads((RESULTS / "load.json").read_text())
    measured = {
        "base_s": fast0["kv"]["median"],
        "inject_s": (fast50["kv"]["median"] - fast0["kv"]["median"]) / 50,
        "ram_s": tiers["seconds"]["ram"]["median"], "disk_s": tiers["seconds"]["disk"]["median"],
        "pull_s": tiers["seconds"]["pull"]["median"],
        "decode_s": (load1["wall_s"] / load1["requests"] - load1["ttft_p50"]) / (load["max_tokens"] - 1),
    }
    for name, value in measured.items():
        assert getattr(COSTS, name) == pytest.approx(value, rel=0.02), name
    assert COSTS.slots == int(load16["requests_per_s"] / load1["requests_per_s"])
    assert COSTS.fact_bytes == tiers["blob_bytes"]
    assert set(cluster_sim.SOURCES) == set(vars(COSTS))


def test_cli_writes_table_json_and_plot(tmp_path, capsys):
    assert main(["bench", "cluster", "--replicas", "1,3", "--users-per-replica", "5", "--facts-per-user", "20",
                 "-k", "10", "--seconds", "20", "--warmup", "5", "--deaths", "0.34", "--user-zipf", "0.5",
                 "--name", "c-zipf0.5", "--out", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    assert table.count("| rendezvous |") == 4 and table.count("| residency |") == 4
    result = json.loads((tmp_path / "c-zipf0.5.json").read_text())  # a dot in the name stays in it
    assert {r["replicas"] for r in result["rows"]} == {1, 3} and result["sources"] == cluster_sim.SOURCES
    assert result["scenario"]["user_zipf"] == 0.5
    assert (tmp_path / "c-zipf0.5.png").stat().st_size > 10_000


def test_the_cluster_sizes_are_not_read_as_replica_urls():
    """`bench cluster --replicas 2,10` once reached the config overlay as the gateway's
    --replicas (engine.url = the sizes)."""
    from kvmem.cli.parser import build_parser
    from kvmem.config_overlay import from_args

    args = build_parser().parse_args(["bench", "cluster", "--replicas", "2,10"])
    assert args.sizes == (2, 10) and from_args(args, env={}).config.engine.url is None
