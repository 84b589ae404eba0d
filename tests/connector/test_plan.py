import pytest

from kvmem.connector.plan import ENCODE, INJECT, Plan, Segment


def test_wire_round_trip_sorts_segments():
    plan = Plan(INJECT, (Segment("b", 10, 5), Segment("a", 0, 10)))
    back = Plan.from_params(plan.to_params())
    assert back.op == INJECT and [s.fact_id for s in back.segments] == ["a", "b"]


def test_absent_plan_is_none_and_broken_plans_raise():
    assert Plan.from_params(None) is None and Plan.from_params({"other": 1}) is None
    with pytest.raises(ValueError):
        Plan.from_params({"kvmem": {"op": "explode"}})
    with pytest.raises(ValueError):
        Plan.from_params(Plan(ENCODE, (Segment("a", 0, 0),)).to_params())


def test_map_from_travels_and_is_dropped_for_a_request_without_the_reader():
    plan = Plan(INJECT, (Segment("head", 0, 10), Segment("a", 10, 5)), map_from=10)
    assert Plan.from_params(plan.to_params()) == plan
    plain = plan.read_with_reader(False)
    assert plain.map_from is None and "map_from" not in plain.to_params()["kvmem"]
    assert plan.read_with_reader(True) is plan
    for bad in (-1, "10", True):
        with pytest.raises(ValueError, match="map_from"):
            Plan.from_params({"kvmem": {**plan.to_params()["kvmem"], "map_from": bad}})


def test_injection_report_round_trips_through_kv_transfer_params():
    from kvmem.connector.plan import InjectionReport

    report = InjectionReport(claimed_tokens=40, local_hit_tokens=8, inject_end=40, injected_segments=3,
                             facts_as_text=1, ram_hits=2, disk_loads=1, fallbacks={"f-1": "stale"}, kv_map=True,
                             held_for_copies=0, ram_tier_hits=9, ram_tier_loads=4)
    params = report.to_params()
    assert InjectionReport.from_params(params) == report
    assert report.facts_from_blobs == 2  # the first injected segment is the prompt's head
    assert InjectionReport.from_params({}) is None and InjectionReport.from_params(None) is None
    # A report from an older connector without the totals reads as zeros, not a KeyError.
    del params["kvmem"]["tier_totals"]
    assert InjectionReport.from_params(params).ram_tier_hits == 0


def test_connector_settings_state_their_defaults_once():
    from kvmem.connector.plan import ConnectorSettings

    settings = ConnectorSettings.from_params({"kv_dir": "/tmp/kv", "fingerprint": "abc"})
    assert settings == ConnectorSettings("/tmp/kv", "abc")
    assert ConnectorSettings.from_params(settings.to_params()) == settings
    # null means "the default", as JSON on a `vllm serve` command line writes it
    nulls = ConnectorSettings.from_params({"kv_dir": "/tmp/kv", "fingerprint": "abc", "codec": None,
                                           "hot_cache_mib": None, "shared_url": None, "reader_adapter": None})
    assert nulls == settings
    for broken in ({"fingerprint": "abc"}, {"kv_dir": "/tmp/kv"}, {"kv_dir": "/tmp/kv", "fingerprint": "abc",
                                                                     "hot_cache_mib": "lots"}):
        with pytest.raises(ValueError, match="kv_connector_extra_config"):
            ConnectorSettings.from_params(broken)


def test_recompute_travels_only_when_on_and_broken_settings_raise():
    from kvmem.kv.recompute import Recompute

    plan = Plan(INJECT, (Segment("head", 0, 10), Segment("a", 10, 5)), recompute=Recompute(0.1, "last"))
    assert Plan.from_params(plan.to_params()) == plan
    off = Plan(INJECT, plan.segments, recompute=Recompute(0.0))
    assert "recompute" not in off.to_params()["kvmem"] and Plan.from_params(off.to_params()).recompute is None
    for bad in ({"fraction": 2}, {"fraction": 0.1, "rule": "psychic"}, "0.1", {"fraction": True}):
        with pytest.raises(ValueError, match="recompute"):
            Plan.from_params({"kvmem": {**plan.to_params()["kvmem"], "recompute": bad}})
