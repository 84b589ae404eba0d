"""Claim planning without an engine: fake requests against a real KV store."""

from types import SimpleNamespace

import pytest

import torch

from kvmem.connector.plan import ENCODE, INJECT, Plan, Segment, Span
from kvmem.connector.scheduler_side import SchedulerSide
from kvmem.kv.blob import KVBlob
from kvmem.kv.store import KVStore

FP = "f" * 64


def store_with(tmp_path, blobs):
    store = KVStore(tmp_path, FP)
    for fact_id, tokens in blobs.items():
        n = len(tokens)
        store.put(KVBlob(fact_id, FP, tuple(tokens), torch.zeros(2, n, 1, 4), torch.zeros(2, n, 1, 4)))
    return store


def request(prompt, segments, rid="r1", op=INJECT):
    return SimpleNamespace(request_id=rid, prompt_token_ids=prompt,
                           kv_transfer_params=Plan(op, tuple(segments)).to_params())


def blocks(ids):
    return SimpleNamespace(get_block_ids=lambda: (ids,))


PROMPT = list(range(10, 40))  # 30 tokens: head [0,4) fact a [4,10) fact b [10,16) tail
SEGS = [Segment("head", 0, 4), Segment("a", 4, 6), Segment("b", 10, 6)]


def test_claims_head_and_facts_and_sends_blocks_and_ranges(tmp_path):
    side = SchedulerSide(store_with(tmp_path, {"head": PROMPT[0:4], "a": PROMPT[4:10], "b": PROMPT[10:16]}), 8)
    req = request(PROMPT, SEGS)
    assert side.get_num_new_matched_tokens(req, 0) == (16, False)
    side.update_state_after_alloc(req, blocks([7, 3, 11, 12]), 16)
    meta = side.build_meta(SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
                                           num_scheduled_tokens={}))
    (job,) = meta.loads
    # Only the blocks the spans touch, and one range per fact: no per-token lists on the wire.
    assert job.req_id == "r1" and job.block_ids == (7, 3)
    assert job.spans == (Span("head", 0, 4), Span("a", 4, 6), Span("b", 10, 6))
    delay, report = side.request_finished(req)
    assert not delay and report.claimed_tokens == 16 and report.facts_from_blobs == 2


def test_worker_expands_ranges_into_the_slots_vllm_uses(tmp_path):
    import torch

    from kvmem.connector.staged import token_map
    from kvmem.connector.plan import LoadJob

    job = LoadJob("r1", (7, 3), (Span("head", 0, 4), Span("a", 4, 6)))
    positions, slots = token_map([job], 8)
    assert positions.tolist() == list(range(10))
    assert slots.tolist() == [56, 57, 58, 59, 60, 61, 62, 63, 24, 25]
    assert slots.dtype == torch.long


def test_local_prefix_hit_shrinks_the_claim(tmp_path):
    side = SchedulerSide(store_with(tmp_path, {"head": PROMPT[0:4], "a": PROMPT[4:10], "b": PROMPT[10:16]}), 8)
    req = request(PROMPT, SEGS)
    assert side.get_num_new_matched_tokens(req, 8) == (8, False)
    side.update_state_after_alloc(req, blocks([7, 3]), 8)
    spans = side._pending_loads["r1"].spans
    assert spans == (Span("a", 8, 2, src=4), Span("b", 10, 6))


def test_claim_stops_before_a_missing_or_mismatched_blob(tmp_path):
    side = SchedulerSide(store_with(tmp_path, {"head": PROMPT[0:4], "a": [1, 2, 3, 4, 5, 6]}), 8)
    req = request(PROMPT, SEGS)
    assert side.get_num_new_matched_tokens(req, 0) == (4, False)  # "a" holds other tokens
    info = side.request_finished(req)[1]
    assert info.fallbacks == {"a": "mismatch", "b": "missing"} and info.facts_as_text == 2


def test_one_claim_reports_every_bad_blob_of_the_prompt(tmp_path):
    """Zero-length, swapped and bit-flipped blobs all found by one request (was: the first only)."""
    segs = [Segment("head", 0, 4), Segment("a", 4, 6), Segment("b", 10, 6), Segment("c", 16, 6), Segment("d", 22, 6)]
    store = store_with(tmp_path, {"head": PROMPT[0:4], "a": PROMPT[4:10], "b": PROMPT[10:16],
                                  "c": PROMPT[16:22], "d": PROMPT[22:28]})
    store.path("a").write_bytes(b"")
    store.path("b").write_bytes(store.path("c").read_bytes())  # c's blob under b's name
    raw = bytearray(store.path("d").read_bytes())
    raw[-1] ^= 0xFF
    store.path("d").write_bytes(bytes(raw))
    store.path("c").unlink()
    side = SchedulerSide(store, 8)
    req = request(PROMPT, segs)
    assert side.get_num_new_matched_tokens(req, 0) == (4, False)
    info = side.request_finished(req)[1]
    assert info.fallbacks == {"a": "corrupt", "b": "corrupt", "c": "missing", "d": "corrupt"}
    assert info.facts_as_text == 4


def test_never_claims_the_last_prompt_token(tmp_path):
    prompt = PROMPT[:16]
    side = SchedulerSide(store_with(tmp_path, {"head": prompt[0:4], "a": prompt[4:10], "b": prompt[10:16]}), 8)
    assert side.get_num_new_matched_tokens(request(prompt, SEGS), 0) == (15, False)


def test_a_gap_between_segments_ends_the_claim(tmp_path):
    side = SchedulerSide(store_with(tmp_path, {"head": PROMPT[0:4], "b": PROMPT[10:16]}), 8)
    req = request(PROMPT, [Segment("head", 0, 4), Segment("b", 10, 6)])
    assert side.get_num_new_matched_tokens(req, 0) == (4, False)


def test_encode_requests_claim_nothing_and_save_when_prefilled(tmp_path):
    side = SchedulerSide(store_with(tmp_path, {}), 8)
    req = request(PROMPT, [Segment("a", 4, 6)], op=ENCODE)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    new = SimpleNamespace(req_id="r1", sampling_params=SimpleNamespace(extra_args={"kv_transfer_params": req.kv_transfer_params}),
                          prompt_token_ids=PROMPT, block_ids=([5, 6, 9, 2],), num_computed_tokens=0)
    meta = side.build_meta(SimpleNamespace(scheduled_new_reqs=[new], scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
                                           num_scheduled_tokens={"r1": 30}))
    (job,) = meta.saves
    assert job.spans == (Span("a", 4, 6),) and job.token_ids == (tuple(PROMPT[4:10]),)
    assert job.block_ids == (5, 6)
    # Its blocks stay allocated until the worker reports the copy out done (delayed free).
    assert side.request_finished(req) == (True, None)


def test_encode_finished_before_its_save_frees_blocks_at_once(tmp_path):
    side = SchedulerSide(store_with(tmp_path, {}), 8)
    req = request(PROMPT, [Segment("a", 4, 6)], op=ENCODE)
    new = SimpleNamespace(req_id="r1", sampling_params=SimpleNamespace(extra_args={"kv_transfer_params": req.kv_transfer_params}),
                          prompt_token_ids=PROMPT, block_ids=([5, 6, 9, 2],), num_computed_tokens=0)
    meta = side.build_meta(SimpleNamespace(scheduled_new_reqs=[new], scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
                                           num_scheduled_tokens={"r1": 4}))  # aborted after a first chunk
    assert meta.saves == []
    assert side.request_finished(req) == (False, None)


def test_checking_a_claim_loads_its_blobs_into_the_ram_tier_the_worker_reads(tmp_path):
    """Prefetch: the scheduler's check leaves each blob decoded in the shared store, so the
    worker's load (store.get, the same call worker_side makes) is a RAM hit, not a disk read."""
    store_with(tmp_path, {"head": PROMPT[0:4], "a": PROMPT[4:10], "b": PROMPT[10:16]})
    shared = KVStore.shared(tmp_path, FP)
    assert KVStore.shared(tmp_path, FP) is shared  # the worker half gets the same instance
    shared.worker_attached = True  # as the worker's connector marks it
    side = SchedulerSide(shared, 8)
    req = request(PROMPT, SEGS)
    side.get_num_new_matched_tokens(req, 0)
    assert (shared.ram_hits, shared.disk_loads) == (0, 3)
    for fact_id in ("head", "a", "b"):
        blob, in_ram = shared.fetch(fact_id)
        assert in_ram and blob.token_ids == tuple(PROMPT[{"head": 0, "a": 4, "b": 10}[fact_id]:][:len(blob.token_ids)])
    assert shared.ram_hits == 3
    _, report = side.request_finished(req)
    assert (report.ram_hits, report.disk_loads) == (0, 3)
    again = request(PROMPT, SEGS, rid="r2")
    side.get_num_new_matched_tokens(again, 0)
    _, report = side.request_finished(again)
    assert (report.ram_hits, report.disk_loads) == (3, 0)


@pytest.mark.parametrize("ram, worker", [(0, True), (512 << 20, False)])
def test_without_a_ram_tier_or_a_worker_beside_it_the_check_keeps_no_tensors(tmp_path, ram, worker):
    store_with(tmp_path, {"head": PROMPT[0:4], "a": PROMPT[4:10], "b": PROMPT[10:16]})
    store = KVStore(tmp_path, FP, hot_cache_bytes=ram)
    store.worker_attached = worker
    side = SchedulerSide(store, 8)
    assert side.get_num_new_matched_tokens(request(PROMPT, SEGS), 0) == (16, False)
    assert store.disk_loads == 0 and not store.fetch("a")[1]
