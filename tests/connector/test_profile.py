"""connector/profile.py: stage timings per request, and their way out of the engine's processes."""

from __future__ import annotations

import time

from kvmem.connector.connector import PROFILE, KvmemStats
from kvmem.connector.plan import InjectionReport
from kvmem.connector.profile import (SCHEDULER_STAGES, STEP_STAGES, WORKER_STAGES, RequestTimings, StepClock,
                                    Stopwatch, to_ms, work_total)


def test_a_stopwatch_sums_each_stage_until_taken():
    watch = Stopwatch()
    for _ in range(2):
        with watch.stage("placement"):
            time.sleep(0.01)
    watch.add("scatter", 0.5)
    totals = watch.take()
    assert set(totals) == {"placement", "scatter"} and totals["placement"] >= 0.02 and totals["scatter"] == 0.5
    assert watch.take() == {}


def test_a_shared_step_is_charged_whole_to_each_request_and_says_by_how_many():
    timings = RequestTimings()
    timings.charge(["a"], {"lookup": 0.001})
    timings.charge(["a", "b"], {"scatter": 0.004})
    assert timings.pop("a") == {"lookup": 0.001, "scatter": 0.004, "shared_step": 2}
    assert timings.pop("a") == {} and timings.drain() == {"b": {"scatter": 0.004, "shared_step": 2}}


def test_timings_of_requests_that_never_report_are_bounded():
    timings = RequestTimings(keep=3)
    for i in range(10):
        timings.charge([f"r{i}"], {"plan": 0.001})
    assert list(timings.drain()) == ["r7", "r8", "r9"]


def test_the_connectors_total_counts_a_nested_stage_once_and_leaves_the_steps_clock_out():
    """premap is timed inside staging; handoff and forward are the step's, not the connector's work."""
    ms = {"lookup": 1.0, "blob_reads": 2.0, "premap": 3.0, "staging": 5.0, "scatter": 4.0,
          "handoff": 7.0, "forward": 90.0, "shared_step": 2}
    assert work_total(ms) == 12.0


def test_the_step_clock_charges_handoff_and_forward_to_the_loading_requests_only():
    timings = RequestTimings()
    clock = StepClock(timings)
    clock.load_started(["a", "b"], time.monotonic() - 0.02)  # the meta was built 20 ms ago
    clock.load_done(["a", "b"])
    time.sleep(0.01)
    clock.forward_done()
    clock.forward_done()  # a step without loads after it charges nothing
    clock.load_started([], time.monotonic())
    clock.load_started(["c"], 0.0)  # a meta from a scheduler that did not stamp it: no handoff
    clock.load_done([])
    clock.forward_done()
    a = timings.pop("a")
    assert a["handoff"] >= 0.02 and 0.01 <= a["forward"] < 1 and a["shared_step"] == 2
    assert timings.pop("c") == {} and timings.drain() == {"b": a}


def test_a_workers_timings_cross_to_the_scheduler_in_its_stats_and_out_in_the_report():
    """The worker's stats (a dict across the process boundary) merge, the counts stay counts."""
    one = KvmemStats(data={"ram_hits": 1, "disk_loads": 0, PROFILE: {"r1": {"scatter": 0.002}}})
    two = KvmemStats(data={"ram_hits": 2, "disk_loads": 1, PROFILE: {"r2": {"staging": 0.001}}})
    merged = KvmemStats(data=dict(one.data)).aggregate(two)
    assert merged.reduce() == {"ram_hits": 3, "disk_loads": 1}
    assert merged.data[PROFILE] == {"r1": {"scatter": 0.002}, "r2": {"staging": 0.001}}
    scheduler = RequestTimings()
    scheduler.charge(["r1"], {"lookup": 0.003})
    scheduler.merge(merged.data[PROFILE])
    report = InjectionReport(claimed_tokens=4, profile_ms=to_ms(scheduler.pop("r1")))
    assert InjectionReport.from_params(report.to_params()).profile_ms == {"lookup": 3.0, "scatter": 2.0}


def test_a_kv_chat_reports_where_its_injection_time_went_inside_the_engine(mem):
    """The real engine: the scheduler's stages come with any KV chat; the worker's with a chat
    that outlives its first step (two tokens); text mode reports none."""
    ids = list(mem.add(facts=["My bike is red.", "I live in Oslo.", "My cat is Tom."], user_id="profile").ids)
    two = mem.chat("Where do I live?", user_id="profile", fact_ids=ids, mode="kv", max_tokens=2)
    assert two.injected_tokens > 0
    assert set(SCHEDULER_STAGES) <= set(two.connector_ms), two.connector_ms
    assert {"blob_reads", "staging", "placement", "scatter"} <= set(two.connector_ms), two.connector_ms
    assert set(two.connector_ms) <= {*SCHEDULER_STAGES, *WORKER_STAGES, *STEP_STAGES, "shared_step"}
    assert all(v >= 0 for v in two.connector_ms.values()) and two.connector_ms["scatter"] > 0
    # the step around the load: the meta's trip to the worker, and the forward pass after the load
    assert "handoff" in two.connector_ms, two.connector_ms
    assert two.connector_ms["handoff"] > 0 and two.connector_ms["forward"] > 0
    assert two.assembly_s > 0
    one = mem.chat("Where do I live?", user_id="profile", fact_ids=ids[::-1], mode="kv", max_tokens=1)
    assert set(SCHEDULER_STAGES) <= set(one.connector_ms)
    assert mem.chat("Where do I live?", user_id="profile", fact_ids=ids, mode="text", max_tokens=1).connector_ms == {}
