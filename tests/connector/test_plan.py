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
