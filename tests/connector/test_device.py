"""The worker side on a simulated second device (simdevice.py): every tensor op must run on the
paged cache's device, as on a GPU, and encode -> blob -> inject must still round-trip exactly.

The first two tests are the two crash paths of the first CUDA-unaware version: the layout
calibration indexed a host tensor with device indices, and encoding moved keys to the host and
un-rotated them there with a kernel the CUDA build registers for CUDA tensors only.
"""

import pytest
import torch

from kvmem.connector.paged import PageLayout
from kvmem.connector.rope import KeyRotator
from kvmem.kv.store import KVStore
from tests.connector.backend import cpu_attention_layer, cpu_cache_writer
from tests.connector.test_placement import assert_rounded
from tests.connector.simdevice import DeviceMismatch, OnDevice, SimulatedDevice, to_device, to_host

# The "device" runs vLLM's CPU kernels on its real data.
pytestmark = pytest.mark.cpu_backend

HEADS, DIM, BS, BLOCKS, LAYERS = 3, 64, 32, 6, 2
FP = "d" * 64
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


@pytest.fixture(scope="module")
def rope():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        return get_rope(DIM, max_position=4096, rope_parameters={"rope_theta": 100000.0, "rope_type": "default"},
                        dtype=torch.bfloat16)


def empty_cache() -> torch.Tensor:
    return torch.zeros(BLOCKS, HEADS, BS, 2 * DIM, dtype=torch.bfloat16)  # the CPU backend's layout


def test_the_simulated_device_catches_a_mix_up():
    with SimulatedDevice():
        on_dev = to_device(torch.ones(4))
        with pytest.raises(DeviceMismatch):
            on_dev + torch.ones(4)
        host = torch.zeros(4)
        with pytest.raises(DeviceMismatch):  # a host tensor indexed with device indices
            host[torch.arange(2).to(on_dev.device)] = 1.0
        assert isinstance(on_dev + torch.ones(4).to(on_dev.device), OnDevice)


def test_calibrated_gather_runs_on_the_cache_device(model_dir):
    write, _ = cpu_cache_writer(str(model_dir), BS, DIM)
    g = torch.Generator().manual_seed(0)
    slots = torch.randperm(BLOCKS * BS, generator=g)[:50]
    key = torch.randn(50, HEADS, DIM, generator=g).to(torch.bfloat16)
    value = torch.randn(50, HEADS, DIM, generator=g).to(torch.bfloat16)
    with SimulatedDevice():
        cache = to_device(empty_cache())
        layout = PageLayout.calibrate(cache, BLOCKS, BS, HEADS, DIM, write)
        dev = cache.device
        write(key.to(dev), value.to(dev), cache, slots.to(dev))
        got_k, got_v = layout.gather(cache, slots.to(dev))
    assert isinstance(got_k, OnDevice) and isinstance(got_v, OnDevice)
    assert torch.equal(to_host(got_k), key) and torch.equal(to_host(got_v), value)


def worker(tmp_path, rope, model_dir, codec="none", kv_map=None):
    from kvmem.connector.worker_side import WorkerSide

    layer = cpu_attention_layer(str(model_dir), BS, DIM)
    return WorkerSide(KVStore(tmp_path, FP), KeyRotator(rope), BS, BLOCKS, HEADS, DIM,
                      {name: layer for name in NAMES}, codec=codec, kv_map=kv_map)


def test_encode_then_inject_on_the_device_round_trips(tmp_path, rope, model_dir):
    from kvmem.connector.paged import slot_mapping
    from kvmem.connector.plan import ConnectorMeta, LoadJob, SaveJob, Span

    side = worker(tmp_path, rope, model_dir)
    rotator = KeyRotator(rope)  # the one the worker applies to every layer
    n, g = 20, torch.Generator().manual_seed(1)
    pre_k = torch.randn(LAYERS, n, HEADS, DIM, generator=g)
    value = torch.randn(LAYERS, n, HEADS, DIM, generator=g).to(torch.bfloat16)
    enc_pos, enc_blocks = torch.arange(25, 25 + n), (2, 4)  # spans blocks 2 and 4
    srv_pos, srv_blocks = torch.arange(3, 3 + n), (5,)
    cached_k = rotator.rotate(pre_k, enc_pos).to(torch.bfloat16)  # what the engine's forward caches
    with SimulatedDevice():
        caches = {name: to_device(empty_cache()) for name in NAMES}
        side.register_kv_caches(caches)
        dev = side.device
        enc_slots = slot_mapping(enc_blocks, enc_pos, BS).to(dev)
        for i, name in enumerate(NAMES):
            side._layers[name].impl.do_kv_cache_update(side._layers[name], cached_k[i].to(dev), value[i].to(dev),
                                                       caches[name], enc_slots)
        side.save(ConnectorMeta(saves=[SaveJob("enc", enc_blocks, (Span("f", 25, n),), (tuple(range(n)),))]))
        assert side.finished({"other"}) == set() and side.finished({"enc"}) == {"enc"}
        side._writer.flush()
        side.load(ConnectorMeta(loads=[LoadJob("srv", srv_blocks, (Span("f", 3, n),))]))
        for name in NAMES:
            side.wait_layer(name)
        assert not side.failed_block_ids
        got_k, got_v = side.gather(slot_mapping(srv_blocks, srv_pos, BS))
    blob = side.store.get("f")
    # The blob holds the keys as cached, where they were encoded.
    assert blob.token_ids == tuple(range(n)) and blob.key_position == 25
    assert torch.equal(blob.key, cached_k) and torch.equal(blob.value, value)
    # Injected at other positions: the cached keys moved there in float32, rounded to the cache dtype.
    moved = cached_k.float().contiguous()
    rotator.move(moved, enc_pos, srv_pos)
    assert torch.equal(got_k, moved.to(torch.bfloat16))
    assert torch.allclose(got_k.float(), rotator.rotate(pre_k, srv_pos), rtol=2**-6, atol=3e-2)
    assert torch.equal(got_v, value)


def test_a_failed_injection_reports_blocks_instead_of_raising(tmp_path, rope, model_dir):
    from kvmem.connector.plan import ConnectorMeta, LoadJob, Span

    side = worker(tmp_path, rope, model_dir)
    with SimulatedDevice():
        side.register_kv_caches({name: to_device(empty_cache()) for name in NAMES})
        side.load(ConnectorMeta(loads=[LoadJob("r", (1, 3), (Span("absent", 30, 10),))]))
    assert side.failed_block_ids == {1, 3}


def _inject(side, spans_blobs, srv_blocks, map_from=None):
    """Put blobs in the store, inject them as one step's spans; -> the cache's K, V at those slots."""
    from kvmem.connector.paged import slot_mapping
    from kvmem.connector.plan import ConnectorMeta, LoadJob

    for blob in spans_blobs.values():
        side.store.put(blob) if blob.key_position is not None else _put_format1(side.store, blob)
    spans = tuple(spans_blobs)
    side.load(ConnectorMeta(loads=[LoadJob("srv", srv_blocks, spans, map_from)]))
    for name in NAMES:
        side.wait_layer(name)
    assert not side.failed_block_ids
    positions = torch.cat([torch.arange(s.start, s.end) for s in spans])
    return side.gather(slot_mapping(srv_blocks, positions, BS))


def _put_format1(store, blob):
    from tests.kv.test_blob import _format1_bytes

    store.dir.mkdir(parents=True, exist_ok=True)
    store.path(blob.fact_id).write_bytes(_format1_bytes(blob.fact_id, blob.key, blob.value, blob.token_ids, FP))


def _cached(seed: int, n: int, position: int, rotator):
    """Keys as a forward caches them at [position, position + n), bf16, with their pre-RoPE form."""
    g = torch.Generator().manual_seed(seed)
    pre = torch.randn(LAYERS, n, HEADS, DIM, generator=g)
    value = torch.randn(LAYERS, n, HEADS, DIM, generator=g).to(torch.bfloat16)
    return pre, rotator.rotate(pre, torch.arange(position, position + n)).to(torch.bfloat16), value


def test_a_fact_served_where_it_was_encoded_is_bit_exact_beside_one_that_moves(tmp_path, rope, model_dir):
    from kvmem.connector.plan import Span
    from kvmem.kv.blob import KVBlob

    side, rotator = worker(tmp_path, rope, model_dir), KeyRotator(rope)
    _, k_stay, v_stay = _cached(1, 10, 0, rotator)
    _, k_move, v_move = _cached(2, 12, 40, rotator)
    blobs = {Span("stay", 0, 10): KVBlob("stay", FP, tuple(range(10)), k_stay, v_stay, 0),
             Span("move", 10, 12): KVBlob("move", FP, tuple(range(12)), k_move, v_move, 40)}
    with SimulatedDevice():
        side.register_kv_caches({name: to_device(empty_cache()) for name in NAMES})
        got_k, got_v = _inject(side, blobs, (0,))
    assert torch.equal(got_k[:, :10], k_stay)  # untouched: no float32 round trip at all
    moved = k_move.float().contiguous()
    rotator.move(moved, torch.arange(40, 52), torch.arange(10, 22))
    assert torch.equal(got_k[:, 10:], moved.to(torch.bfloat16))
    assert torch.equal(got_v, torch.cat((v_stay, v_move), dim=1))


def _head_and_fact(rotator) -> dict:
    """A 10-token header served where it was encoded, and a 12-token fact encoded at 40 served at 10."""
    from kvmem.connector.plan import Span
    from kvmem.kv.blob import KVBlob

    _, k_head, v_head = _cached(6, 10, 0, rotator)
    _, k_fact, v_fact = _cached(7, 12, 40, rotator)
    return {Span("head", 0, 10): KVBlob("head", FP, tuple(range(10)), k_head, v_head, 0),
            Span("fact", 10, 12): KVBlob("fact", FP, tuple(range(12)), k_fact, v_fact, 40)}


def test_the_readers_kv_map_reaches_the_facts_and_never_the_header(tmp_path, rope, model_dir):
    """Oracle: with a KV map, a chat that asks for it (map_from) gets each fact token's key and
    value through the map, after the move (in float32, rounded once); the header before map_from,
    and a chat that does not ask, get exactly what they get without a map."""
    from kvmem.connector.plan import Span
    from kvmem.reader.kvmap import rotate_half
    from tests.reader.test_kvmap import random_map

    kv_map = random_map(LAYERS, HEADS, DIM)
    rotator = KeyRotator(rope)
    blobs = _head_and_fact(rotator)
    k_fact, v_fact = blobs[Span("fact", 10, 12)].key, blobs[Span("fact", 10, 12)].value
    got = {}
    for name, with_map, map_from in (("plain", None, None), ("mapped", kv_map, 10), ("not asked", kv_map, None)):
        side = worker(tmp_path / name, rope, model_dir, kv_map=with_map)
        with SimulatedDevice():
            side.register_kv_caches({n: to_device(empty_cache()) for n in NAMES})
            got[name] = _inject(side, blobs, (0,), map_from)
    plain_k, plain_v = got["plain"]
    assert all(torch.equal(a, b) for a, b in zip(got["not asked"], got["plain"]))
    k, v = got["mapped"]
    assert torch.equal(k[:, :10], plain_k[:, :10]) and torch.equal(v[:, :10], plain_v[:, :10])
    moved = k_fact.float().contiguous()
    rotator.move(moved, torch.arange(40, 52), torch.arange(10, 22))
    # [L, N, H, D] float32: the map reads the moved key before it is rounded to the cache dtype
    a, b = (torch.cat((t, t), dim=-1)[:, None] for t in (kv_map.key_a, kv_map.key_b))  # [L, 1, H, D]
    assert_rounded(k[:, 10:], a * moved + b * rotate_half(moved))  # the worker maps with the fused kernel
    scale, shift = kv_map.value_scale[:, None], kv_map.value_shift[:, None]
    assert torch.equal(v[:, 10:], (scale * v_fact.float() + shift).to(torch.bfloat16))
    assert not torch.equal(k[:, 10:], plain_k[:, 10:])


def test_a_kv_map_on_partial_rotary_pairs_as_the_lab_does_and_a_whole_head_map_is_refused(tmp_path, model_dir):
    """Oracle, partial rotary (Phi-3 shapes, issue 44): a map made for R = D/2 rotated dims maps
    each fact key as the lab's KVMap.keys does, after the move; a map pairing the whole head
    would not commute with RoPE there, so the worker drops it (plain KV, the reason kept)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from kvmem.connector.plan import Span
    from kvmem.reader.kvmap import pair_swap
    from tests.reader.test_kvmap import random_map

    with set_current_vllm_config(VllmConfig()):
        partial = get_rope(DIM, max_position=4096, dtype=torch.bfloat16,
                           rope_parameters={"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.5})
    assert partial.rotary_dim == DIM // 2
    rotator = KeyRotator(partial)
    blobs = _head_and_fact(rotator)
    k_fact = blobs[Span("fact", 10, 12)].key
    kv_map = random_map(LAYERS, HEADS, DIM, rotary_dim=DIM // 2)
    got, refusals = {}, {}
    for name, with_map in (("plain", None), ("mapped", kv_map), ("whole head", random_map(LAYERS, HEADS, DIM))):
        side = worker(tmp_path / name, partial, model_dir, kv_map=with_map)
        with SimulatedDevice():
            side.register_kv_caches({n: to_device(empty_cache()) for n in NAMES})
            got[name] = _inject(side, blobs, (0,), 10)
        refusals[name] = side.map_refusal
    assert refusals["mapped"] is None and "rotary_dim 32" in refusals["whole head"]
    assert all(torch.equal(a, b) for a, b in zip(got["whole head"], got["plain"]))
    moved = k_fact.float().contiguous()
    rotator.move(moved, torch.arange(40, 52), torch.arange(10, 22))
    # [L, N, H, D] float32: the map reads the moved key before it is rounded to the cache dtype
    a, b = (t[:, None] for t in kv_map.key_factors())  # [L, 1, H, D]
    assert_rounded(got["mapped"][0][:, 10:], a * moved + b * pair_swap(moved, DIM // 2))


def test_a_kv_map_for_another_shape_is_dropped_at_start_and_chats_read_plain_kv(tmp_path, rope, model_dir):
    """A map that does not fit used to raise here, in the worker, and vLLM then failed to start:
    now the worker drops it, says why, and a chat that asks for the map gets plain KV."""
    from tests.reader.test_kvmap import random_map

    blobs = _head_and_fact(KeyRotator(rope))
    got = {}
    for name, with_map in (("plain", None), ("unfit", random_map(LAYERS, HEADS + 1, DIM))):
        side = worker(tmp_path / name, rope, model_dir, kv_map=with_map)
        with SimulatedDevice():
            side.register_kv_caches({n: to_device(empty_cache()) for n in NAMES})
            got[name] = _inject(side, blobs, (0,), 10)
        refusal = side.map_refusal
    assert refusal and "kv_heads" in refusal
    assert all(torch.equal(a, b) for a, b in zip(got["unfit"], got["plain"]))


def test_format_1_blobs_inject_beside_format_2_ones(tmp_path, rope, model_dir):
    """A pre-RoPE float32 blob written before format 2 is rotated to its serving position."""
    from kvmem.connector.plan import Span
    from kvmem.kv.blob import KVBlob

    side, rotator = worker(tmp_path, rope, model_dir), KeyRotator(rope)
    pre_old, _, v_old = _cached(3, 8, 0, rotator)
    _, k_new, v_new = _cached(4, 8, 8, rotator)
    blobs = {Span("old", 0, 8): KVBlob("old", FP, tuple(range(8)), pre_old, v_old, None),
             Span("new", 8, 8): KVBlob("new", FP, tuple(range(8)), k_new, v_new, 8)}
    with SimulatedDevice():
        side.register_kv_caches({name: to_device(empty_cache()) for name in NAMES})
        got_k, got_v = _inject(side, blobs, (1,))
    assert torch.equal(got_k[:, :8], rotator.rotate(pre_old, torch.arange(8)).to(torch.bfloat16))
    assert torch.equal(got_k[:, 8:], k_new)
    assert torch.equal(got_v, torch.cat((v_old, v_new), dim=1))


@pytest.mark.parametrize("codec", ["int8", "int4", "k8v4", "k4v8", "int7", "int6", "int4h", "k7v8"])
def test_coded_blobs_are_encoded_and_decoded_on_their_way(tmp_path, rope, model_dir, codec):
    """Encode with a codec, inject where encoded: the cache gets the codec's decode of the keys."""
    from kvmem.connector.paged import slot_mapping
    from kvmem.connector.plan import ConnectorMeta, SaveJob, Span
    from kvmem.kv.codec import encode, role_codecs

    keys, values = role_codecs(codec)
    side, rotator = worker(tmp_path, rope, model_dir, codec=codec), KeyRotator(rope)
    n = 9
    _, cached_k, value = _cached(5, n, 32, rotator)
    with SimulatedDevice():
        caches = {name: to_device(empty_cache()) for name in NAMES}
        side.register_kv_caches(caches)
        slots = slot_mapping((0, 2), torch.arange(32, 32 + n), BS).to(side.device)
        for i, name in enumerate(NAMES):
            side._layers[name].impl.do_kv_cache_update(side._layers[name], cached_k[i].to(side.device),
                                                       value[i].to(side.device), caches[name], slots)
        side.save(ConnectorMeta(saves=[SaveJob("enc", (0, 2), (Span("f", 32, n),), (tuple(range(n)),))]))
        side.finished({"enc"})
        side._writer.flush()
        blob = side.store.get("f")
        got_k, got_v = _inject(side, {Span("f", 32, n): blob}, (4, 3))
    assert blob.codec == codec and blob.key_position == 32
    assert torch.equal(got_k, encode(cached_k, keys).decode(torch.bfloat16))
    assert torch.equal(got_v, encode(value, values).decode(torch.bfloat16))
    assert not torch.equal(got_k, cached_k)  # lossy
