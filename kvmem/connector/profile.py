"""Where an injection's time goes inside the engine: per-request stage timings (`bench ttft --profile`).

Both halves of the connector time their own work with a `Stopwatch`:
- scheduler side (engine-core process): `lookup` (blob header checks and RAM-tier warm-up while
  claiming), `plan` (block ids -> load job), `meta` (this step's loads and saves for the worker);
- worker side (worker process): `blob_reads` (fetching the blobs from the RAM tier or disk),
  `premap` (the reader's KV map applied to blobs the mapped tier has not seen: once per fact),
  `staging` (gathering their tokens into the host staging buffer), `placement` (decoding and
  re-positioning keys, the KV map), `scatter` (the backend's cache-update op writing pages),
  `recompute` (selective recompute). `premap` runs inside `staging`: it is part of its time.

Around the worker's load, the step's clock (`StepClock`, connector.py's hooks): `handoff`, from
the scheduler's meta built (engine core) to the worker's load starting, and `forward`, from the
load done to the forward pass done (`wait_for_save`). Both read the host's monotonic clock in two
processes, which vLLM's executor always starts on one host. They are not the connector's work:
the floor (a prefix-cache hit) has a handoff and a forward of its own.

The worker's timings of a step reach the scheduler with the step's connector stats, after vLLM
has already finished the requests of that step: a request answered in its first step (one output
token) reports only the scheduler side; ask for two tokens to get both. When several requests
share a step, each is charged the whole step's worker time (its `shared_step` says by how many).

On the CPU backend the worker's ops run synchronously, so these are wall times of the work
itself; on CUDA they are the host's time to queue it (the copies overlap the forward).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from contextlib import contextmanager
from typing import Iterator, Mapping

SCHEDULER_STAGES = ("lookup", "plan", "meta")
WORKER_STAGES = ("blob_reads", "premap", "staging", "placement", "scatter", "recompute")
NESTED = {"premap": "staging"}  # a stage timed inside another: not added again to a total
STEP_STAGES = ("handoff", "forward")  # the injecting step around the load (StepClock)
KEEP = 1024  # requests whose timings wait for their report, at most (the oldest go first)


class Stopwatch:
    """Seconds per stage, summed over every `stage()` block since the last `take()`."""

    def __init__(self) -> None:
        self._totals: dict[str, float] = {}

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        self._totals[name] = self._totals.get(name, 0.0) + seconds

    def take(self) -> dict[str, float]:
        """The totals so far; the watch starts again from zero."""
        totals, self._totals = self._totals, {}
        return totals


class RequestTimings:
    """Stage seconds per request id, until the request's report takes them (bounded: a request
    that never reports, e.g. aborted, is dropped once KEEP newer ones wait)."""

    def __init__(self, keep: int = KEEP) -> None:
        self._by_request: OrderedDict[str, dict[str, float]] = OrderedDict()
        self._keep = keep

    def charge(self, req_ids, seconds: Mapping[str, float]) -> None:
        """Add these stage seconds to each of `req_ids` (a step's work is charged whole to each)."""
        req_ids = list(req_ids)
        for req_id in req_ids:
            mine = self._by_request.setdefault(req_id, {})
            for name, s in seconds.items():
                mine[name] = mine.get(name, 0.0) + s
            if len(req_ids) > 1:
                mine["shared_step"] = max(mine.get("shared_step", 1), len(req_ids))
            self._by_request.move_to_end(req_id)
        while len(self._by_request) > self._keep:
            self._by_request.popitem(last=False)

    def merge(self, by_request: Mapping[str, Mapping[str, float]]) -> None:
        """Timings another process measured, per request (a worker's, carried by its stats)."""
        for req_id, seconds in by_request.items():
            self.charge([req_id], {k: v for k, v in seconds.items() if k != "shared_step"})
            if "shared_step" in seconds:
                self._by_request[req_id]["shared_step"] = seconds["shared_step"]

    def pop(self, req_id: str) -> dict[str, float]:
        return self._by_request.pop(req_id, {})

    def drain(self) -> dict[str, dict[str, float]]:
        """Every request's timings so far, handed over (the worker's per step)."""
        out = dict(self._by_request)
        self._by_request.clear()
        return out


class StepClock:
    """The injecting requests' step around the worker's load: `handoff` and `forward` (module doc).

    Worker process: connector.py calls `load_started` and `load_done` in start_load_kv, around the
    load, and `forward_done` in wait_for_save, after the forward pass; `timings` is the worker's."""

    def __init__(self, timings: RequestTimings) -> None:
        self._timings = timings
        self._loaded: tuple[float, list[str]] | None = None  # when this step's load ended, for whom

    def load_started(self, req_ids: list[str], built_at: float) -> None:
        """`built_at`: the scheduler's time.monotonic() when it built this step's meta (0: unknown)."""
        if req_ids and built_at > 0:
            self._timings.charge(req_ids, {"handoff": max(0.0, time.monotonic() - built_at)})

    def load_done(self, req_ids: list[str]) -> None:
        self._loaded = (time.monotonic(), req_ids) if req_ids else None

    def forward_done(self) -> None:
        if self._loaded is not None:
            at, req_ids = self._loaded
            self._loaded = None
            self._timings.charge(req_ids, {"forward": time.monotonic() - at})


def work_total(ms: Mapping[str, float]) -> float:
    """The connector's own work in a request's stage timings: every scheduler and worker stage,
    a nested one (premap) once, the step's clock (handoff, forward) and counts left out."""
    return sum(ms.get(n, 0.0) for n in (*SCHEDULER_STAGES, *WORKER_STAGES) if n not in NESTED)


def to_ms(seconds: Mapping[str, float]) -> dict[str, float]:
    """Stage seconds -> milliseconds as a report carries them (`shared_step` stays a count)."""
    return {k: (v if k == "shared_step" else round(v * 1e3, 4)) for k, v in seconds.items()}
