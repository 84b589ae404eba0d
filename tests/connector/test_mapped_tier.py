"""The worker's tier of mapped blobs (connector/mapped_tier.py): a blob mapped once, as the lab
maps it, kept while the store serves that very blob; and the worker on the CPU backend serving
a mapped chat's facts from it: the same K/V as mapping them in the step, to bf16 rounding."""

import pytest
import torch

from kvmem.connector.mapped_tier import MappedTier
from kvmem.connector.placement import DeviceKVMap
from kvmem.connector.rope import KeyRotator
from kvmem.kv.blob import KVBlob
from kvmem.kv.codec import encode
from kvmem.reader.kvmap import pair_swap
from tests.connector.test_device import (  # noqa: F401 - rope is a fixture
    BS, DIM, FP, HEADS, LAYERS, NAMES, _head_and_fact, _inject, empty_cache, rope, worker)
from tests.connector.test_placement import assert_rounded
from tests.reader.test_kvmap import random_map

pytestmark = pytest.mark.cpu_backend


def blob(fact_id="f", n=7, seed=0) -> KVBlob:
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(LAYERS, n, HEADS, DIM, generator=g).to(torch.bfloat16) for _ in range(2))
    return KVBlob(fact_id, FP, tuple(range(n)), k, v, 30)


def test_a_blob_is_mapped_as_the_lab_maps_it_and_only_once():
    kv_map = random_map(LAYERS, HEADS, DIM)
    tier = MappedTier(DeviceKVMap.on(kv_map, torch.device("cpu")), 1 << 30)
    b = blob()
    (got,) = tier.get([b])
    assert got.key_position == b.key_position and got.token_ids == b.token_ids
    k, v = b.key.float(), b.value.float()
    for layer in range(LAYERS):
        a, bb = (t[layer] for t in kv_map.key_factors())
        assert_rounded(got.key[layer], a * k[layer] + bb * pair_swap(k[layer]))
    want_v = (v * kv_map.value_scale[:, None] + kv_map.value_shift[:, None]).to(torch.bfloat16)
    assert torch.equal(got.value, want_v)
    assert tier.get([b]) == [got] and (tier.maps, tier.hits) == (1, 1)
    again = blob()  # the store read the fact again (or it was rewritten): a new blob, mapped anew
    assert tier.get([again])[0] is not got and tier.maps == 2


def test_the_same_file_read_again_is_not_mapped_again_and_a_rewritten_one_is():
    """Under load the store's RAM tier lets blobs go and reads them again: a new object from the
    same file (the same checksum) keeps its mapped copy; a rewritten fact (a new checksum) does not."""
    from kvmem.kv.blob import decode_blob, encode_blob

    tier = MappedTier(DeviceKVMap.on(random_map(LAYERS, HEADS, DIM), torch.device("cpu")), 1 << 30)
    data = encode_blob(blob())
    first, again = (decode_blob(bytearray(data), "f", FP) for _ in range(2))
    assert first is not again and first.digest is not None and first.digest == again.digest
    (mapped,) = tier.get([first])
    assert tier.get([again]) == [mapped] and (tier.maps, tier.hits) == (1, 1)
    assert tier._entries.bytes == mapped.nbytes  # known by its checksum: the source is not held
    rewritten = decode_blob(bytearray(encode_blob(blob(seed=1))), "f", FP)
    assert tier.get([rewritten])[0] is not mapped and tier.maps == 2


def test_coded_blobs_are_left_to_the_step_and_the_budget_holds():
    tier = MappedTier(DeviceKVMap.on(random_map(LAYERS, HEADS, DIM), torch.device("cpu")), 0)
    b = blob()
    coded = KVBlob("c", FP, b.token_ids, encode(b.key, "int8"), encode(b.value, "int8"), 30)
    assert tier.get([coded]) == [None]
    small = MappedTier(tier._map, 3 * b.nbytes)  # room for one blob and its mapped copy, not two
    (first,) = small.get([blob("a")])
    small.get([blob("b", seed=1)])
    assert small._entries.keys() == ["b"] and small._entries.bytes == 2 * b.nbytes
    assert small.get([blob("a")])[0] is not first  # evicted: mapped again


def load_again(side, spans_blobs, map_from):
    """_inject without storing the blobs again (which would make them new blobs)."""
    from kvmem.connector.paged import slot_mapping
    from kvmem.connector.plan import ConnectorMeta, LoadJob

    spans = tuple(spans_blobs)
    side.load(ConnectorMeta(loads=[LoadJob("srv", (0,), spans, map_from)]))
    assert not side.failed_block_ids
    return side.gather(slot_mapping((0,), torch.cat([torch.arange(s.start, s.end) for s in spans]), BS))


def test_the_worker_serves_mapped_facts_from_the_tier_on_the_cpu_backend(tmp_path, rope, model_dir):
    """No simulated device: the worker's cache is on the host, so the tier is on. The fact is
    mapped where it was encoded and then moved; against mapping it after the move (the step's
    path, tests/connector/test_device.py) that rounds once more to bf16, so they agree to a step."""
    from kvmem.connector.plan import Span

    kv_map = random_map(LAYERS, HEADS, DIM)
    rotator = KeyRotator(rope)
    blobs = _head_and_fact(rotator)
    fact = blobs[Span("fact", 10, 12)]
    got = {}
    for name, with_map, map_from in (("plain", None, None), ("mapped", kv_map, 10)):
        side = worker(tmp_path / name, rope, model_dir, kv_map=with_map)
        side.register_kv_caches({n: empty_cache() for n in NAMES})
        got[name] = [_inject(side, blobs, (0,), map_from), load_again(side, blobs, map_from)]
        if name == "mapped":
            tier = side._mapped_tier
            assert (tier.maps, tier.hits) == (1, 1)  # the header is never mapped; the fact once
            not_asked = load_again(side, blobs, None)  # the same worker, a chat without the map
    (k, v), (k2, v2) = got["mapped"]
    plain_k, plain_v = got["plain"][0]
    assert torch.equal(k, k2) and torch.equal(v, v2)
    assert all(torch.equal(a, b) for a, b in zip(not_asked, (plain_k, plain_v)))
    assert torch.equal(k[:, :10], plain_k[:, :10]) and torch.equal(v[:, :10], plain_v[:, :10])
    a, b = (t[:, None] for t in kv_map.key_factors())  # [L, 1, H, D]
    moved = fact.key.float().contiguous()
    rotator.move(moved, torch.arange(40, 52), torch.arange(10, 22))
    want = a * moved + b * pair_swap(moved)  # [L, N, H, D] float32: the lab's
    assert torch.allclose(k[:, 10:].float(), want, rtol=2**-7, atol=2**-6)
    assert not torch.allclose(k[:, 10:].float(), moved, rtol=2**-7, atol=2**-6)
    want_v = (kv_map.value_scale[:, None] * fact.value.float() + kv_map.value_shift[:, None]).to(torch.bfloat16)
    assert torch.equal(v[:, 10:], want_v)


def test_a_steps_new_blobs_are_mapped_together_as_each_alone():
    key_map = DeviceKVMap.on(random_map(LAYERS, HEADS, DIM), torch.device("cpu"))
    tier, alone = MappedTier(key_map, 1 << 30), MappedTier(key_map, 1 << 30)
    a, b, c = blob("a", 5, 1), blob("b", 9, 2), blob("c", 3, 3)
    coded = KVBlob("x", FP, c.token_ids, encode(c.key, "int8"), encode(c.value, "int8"), 30)
    (held,) = tier.get([c])
    got = tier.get([a, b, a, coded, c])
    assert got[0] is got[2] and got[3] is None and got[4] is held
    assert (tier.maps, tier.hits) == (3, 1)  # c once before, a and b once each now
    for one, mapped in ((a, got[0]), (b, got[1])):
        (want,) = alone.get([one])
        assert torch.equal(mapped.key, want.key) and torch.equal(mapped.value, want.value)
        assert mapped.key.is_contiguous() and mapped.key.shape == one.key.shape
    # the tier's kept buffers, dirtied by that larger step, give a later small step the same bits
    d = blob("d", 4, 4)
    (fresh,) = MappedTier(key_map, 1 << 30).get([d])
    (kept,) = tier.get([d])
    assert torch.equal(kept.key, fresh.key) and torch.equal(kept.value, fresh.value)
    assert kept.key.untyped_storage().nbytes() == kept.key.nbytes  # its own tensors, not the buffer
