"""Scheduler side of the connector: decide what to claim, hand load/save jobs to the worker.

Runs in vLLM's engine-core process. It checks blobs through the KV store (header and checksum,
verified once per file version), which also loads them into the RAM tier that the worker reads
from when both run in one process, and sends the worker block ids and token ranges (plan.py's
LoadJob / SaveJob).

Encode requests keep their blocks after they finish until the worker has copied their KV out
(vLLM's delayed-free protocol: request_finished returns True, the worker's get_finished reports
the request once the copy is done).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from kvmem.connector.plan import ENCODE, INJECT, ConnectorMeta, InjectionReport, LoadJob, Plan, SaveJob, Segment, Span
from kvmem.connector.profile import RequestTimings, Stopwatch
from kvmem.errors import BlobError
from kvmem.kv.recompute import Recompute
from kvmem.kv.store import KVStore

log = logging.getLogger("kvmem.connector")


@dataclass
class Claim:
    """What an inject request gets: its first `end` prompt tokens come from these segments."""

    segments: list[Segment]
    end: int
    map_from: int | None  # the plan's (the KV map from this prompt position on)
    fallbacks: dict[str, str]  # fact id -> reason, for every blob of the plan that cannot be used
    facts_as_text: int  # segments served by text prefill because of that blob
    local_hit: int = 0
    claimed: int = 0
    ram_hits: int = 0  # blobs already in the shared RAM tier when checked
    disk_loads: int = 0  # blobs read from disk into the shared RAM tier when checked (0 without one)
    recompute: Recompute | None = None  # the plan's, where the worker can recompute
    recomputed: int = 0  # fact tokens the worker recomputes (kv/recompute.py counts per fact)


@dataclass
class _SaveTracker:
    plan: Plan
    prompt: list[int]
    block_ids: list[int]
    computed: int = 0


class SchedulerSide:
    def __init__(self, store: KVStore, block_size: int, kv_map: bool = False, recompute: bool = True) -> None:
        self.store = store
        self.recompute = recompute  # the worker can drive this model's layers (connector/recompute.py)
        self.kv_map = kv_map  # the worker sends facts of chats that ask (Plan.map_from) through a KV map
        self.block_size = block_size
        self._claims: dict[str, Claim] = {}
        self._pending_loads: dict[str, LoadJob] = {}
        self._saves: dict[str, _SaveTracker] = {}
        self._saving: set[str] = set()  # save sent to the worker: blocks are freed when it says so
        self._held: set[str] = set()  # finished, blocks kept until the worker reports its copy done
        self.fallback_total = 0
        self.timings = RequestTimings()  # per request: this side's stage seconds, and the worker's (profile.py)
        self._watch = Stopwatch()

    # -- vLLM hooks -----------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        plan = _plan_of(request)
        if plan is None or plan.op != INJECT:
            return 0, False
        claim = self._claims.get(request.request_id)
        if claim is None:
            with self._watch.stage("lookup"):
                claim = self._claims[request.request_id] = self._claim(request, plan)
            self.timings.charge([request.request_id], self._watch.take())
        claim.local_hit = num_computed_tokens
        claim.claimed = max(0, claim.end - num_computed_tokens)
        return claim.claimed, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        claim = self._claims.get(request.request_id)
        if claim is None or num_external_tokens == 0:
            return
        with self._watch.stage("plan"):
            self._plan_load(request, claim, blocks, num_external_tokens)
        self.timings.charge([request.request_id], self._watch.take())

    def _plan_load(self, request, claim: Claim, blocks, num_external_tokens: int) -> None:
        block_ids = blocks.get_block_ids()[0]
        first = claim.end - num_external_tokens
        spans = _spans(claim.segments, first, claim.end)
        rec = claim.recompute if self.recompute else None
        if rec is not None:  # the facts' loaded tokens (never the head, the segment at position 0)
            claim.recomputed = sum(rec.count(s.length) for s in spans if s.start - s.src > 0)
        self._pending_loads[request.request_id] = LoadJob(
            request.request_id, tuple(block_ids[: -(-claim.end // self.block_size)]), spans, claim.map_from, rec)

    def build_meta(self, scheduler_output) -> ConnectorMeta:
        with self._watch.stage("meta"):
            meta = self._build_meta(scheduler_output)
        self.timings.charge([job.req_id for job in meta.loads], self._watch.take())
        meta.built_at = time.monotonic()
        return meta

    def _build_meta(self, scheduler_output) -> ConnectorMeta:
        meta = ConnectorMeta(loads=list(self._pending_loads.values()))
        self._pending_loads.clear()
        for new in scheduler_output.scheduled_new_reqs:
            plan = Plan.from_params(_params_of(new.sampling_params))
            if plan is not None and plan.op == ENCODE:
                self._saves[new.req_id] = _SaveTracker(plan, list(new.prompt_token_ids), list(new.block_ids[0]),
                                                       new.num_computed_tokens)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracker = self._saves.get(req_id)
            if tracker is not None and cached.new_block_ids[i] is not None:
                if req_id in cached.resumed_req_ids:
                    tracker.block_ids = list(cached.new_block_ids[i][0])
                else:
                    tracker.block_ids.extend(cached.new_block_ids[i][0])
        for req_id, tracker in list(self._saves.items()):
            tracker.computed += scheduler_output.num_scheduled_tokens.get(req_id, 0)
            if tracker.computed >= max(s.end for s in tracker.plan.segments):
                meta.saves.append(_save_job(req_id, tracker, self.block_size))
                self._saving.add(req_id)
                del self._saves[req_id]
        return meta

    def request_finished(self, request) -> tuple[bool, InjectionReport | None]:
        """-> (delay freeing the blocks, what was injected: None for a request with no claim).

        Blocks are kept while the worker still copies an encode's KV out of them; it reports the
        request in get_finished once the copy is done, and vLLM frees them then.
        """
        self._saves.pop(request.request_id, None)
        self._pending_loads.pop(request.request_id, None)
        delay = request.request_id in self._saving
        self._saving.discard(request.request_id)
        if delay:
            self._held.add(request.request_id)
        claim = self._claims.pop(request.request_id, None)
        if claim is None:
            self.timings.pop(request.request_id)
            return delay, None
        return delay, InjectionReport(
            claimed_tokens=claim.claimed, local_hit_tokens=claim.local_hit, inject_end=claim.end,
            injected_segments=len(claim.segments), facts_as_text=claim.facts_as_text, ram_hits=claim.ram_hits,
            disk_loads=claim.disk_loads, fallbacks=claim.fallbacks,
            kv_map=self.kv_map and claim.map_from is not None and claim.map_from < claim.end,
            recomputed_tokens=claim.recomputed,
            held_for_copies=len(self._held),  # encodes whose blocks still wait for the worker
        )

    def copies_done(self, req_ids) -> None:
        """The worker reported these encodes' copies done (vLLM frees their blocks now)."""
        self._held.difference_update(req_ids)

    # -- planning -------------------------------------------------------------------------------

    def _claim(self, request, plan: Plan) -> Claim:
        """The longest run of usable segments from token 0; never the last prompt token."""
        prompt = request.prompt_token_ids
        usable: list[Segment] = []
        end = 0
        fallbacks: dict[str, str] = {}
        tiers = {True: 0, False: 0, None: 0}  # in RAM already (None: only checked) -> blobs
        for i, seg in enumerate(plan.segments):
            reason = self._unusable(seg, end, prompt, tiers)
            if reason is not None:
                fallbacks[seg.fact_id] = reason
                # Only a prefix can be injected, but every later blob is checked too, so one chat
                # reports (and the service re-encodes) all of a prompt's bad blobs, not the first.
                fallbacks.update(self._bad_blobs(plan.segments[i + 1 :], prompt))
                break
            usable.append(seg)
            end = seg.end
        as_text = len(plan.segments) - len(usable)
        ram_hits, disk_loads = tiers[True], tiers[False]
        if as_text:
            self.fallback_total += as_text
            log.warning("request %s: %d of %d segments served as text (%s); %d fallbacks so far",
                        request.request_id, as_text, len(plan.segments), fallbacks, self.fallback_total)
        rec = plan.recompute if plan.recompute is not None and plan.recompute.on else None
        return Claim(usable, min(end, len(prompt) - 1), plan.map_from, fallbacks, as_text, ram_hits=ram_hits,
                     disk_loads=disk_loads, recompute=rec)

    def _bad_blobs(self, segments, prompt: list[int]) -> dict[str, str]:
        """fact id -> reason for each of these segments whose blob cannot serve its tokens."""
        bad = {}
        for seg in segments:
            reason = self._unusable(seg, seg.start, prompt)
            if reason is not None:
                bad[seg.fact_id] = reason
        return bad

    def _unusable(self, seg: Segment, expected_start: int, prompt: list[int], tiers: dict | None = None) -> str | None:
        if seg.start != expected_start:
            return "gap"  # only a prefix can be supplied: segments must follow each other
        if seg.end > len(prompt):
            return "beyond prompt"
        try:
            if tiers is None:  # a blob past the injected prefix: checked, not loaded
                token_ids = self.store.token_ids(seg.fact_id)
            else:
                token_ids, in_ram = self.store.warm(seg.fact_id)
                tiers[in_ram] += 1
        except BlobError as e:
            log.warning("%s", e)
            return e.reason
        if list(token_ids) != list(prompt[seg.start : seg.end]):
            return BlobError.MISMATCH
        return None


def _spans(segments: list[Segment], first: int, end: int) -> tuple[Span, ...]:
    """Segments cut to prompt tokens [first, end) (a local prefix-cache hit covers the rest)."""
    spans = []
    for seg in segments:
        lo, hi = max(seg.start, first), min(seg.end, end)
        if lo < hi:
            spans.append(Span(seg.fact_id, lo, hi - lo, src=lo - seg.start))
    return tuple(spans)


def _save_job(req_id: str, tracker: _SaveTracker, block_size: int) -> SaveJob:
    segments = tracker.plan.segments
    last = max(s.end for s in segments)
    return SaveJob(req_id, tuple(tracker.block_ids[: -(-last // block_size)]),
                   tuple(Span(s.fact_id, s.start, s.length) for s in segments),
                   tuple(tuple(tracker.prompt[s.start : s.end]) for s in segments))


def _params_of(sampling_params) -> dict[str, Any] | None:
    extra = getattr(sampling_params, "extra_args", None) or {}
    return extra.get("kv_transfer_params")


def _plan_of(request) -> Plan | None:
    try:
        return Plan.from_params(request.kv_transfer_params)
    except (ValueError, TypeError) as e:
        log.warning("request %s: ignoring malformed kvmem plan: %s", request.request_id, e)
        return None
