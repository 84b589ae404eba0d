import pytest

from kvmem.engine.plan import ENCODE, INJECT, Plan, Segment


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
