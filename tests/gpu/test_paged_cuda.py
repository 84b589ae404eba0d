"""On a CUDA device: the layout-calibrated gather against vLLM's FlashAttention cache-write op,
the rotary kernel against vLLM's reference, and the worker side's encode -> inject round trip
with its side stream and pinned staging. Skipped where no CUDA device exists (conftest.py)."""

from types import SimpleNamespace

import pytest
import torch

from kvmem.connector.paged import PageLayout, slot_mapping
from kvmem.connector.rope import KeyRotator
from kvmem.kv.store import KVStore

HEADS, DIM, BS, BLOCKS, LAYERS = 8, 128, 16, 12, 3
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def flash_layer():
    """An attention-layer stand-in whose do_kv_cache_update is FlashAttentionImpl's own method."""
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl

    impl = SimpleNamespace(attn_type=AttentionType.DECODER, head_size=DIM, kv_cache_dtype="auto")
    impl.do_kv_cache_update = lambda layer, k, v, cache, slots: FlashAttentionImpl.do_kv_cache_update(
        impl, layer, k, v, cache, slots)
    one = torch.ones((), device="cuda")
    layer = SimpleNamespace(impl=impl, _k_scale=one, _v_scale=one, _k_scale_float=1.0, _v_scale_float=1.0)
    return layer, (BLOCKS, HEADS, BS, 2 * DIM)  # vLLM 0.32's flash layout: [B, H, N, 2*D], K and V side by side


@pytest.fixture(scope="module")
def rope():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    params = {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    with set_current_vllm_config(VllmConfig()):
        return get_rope(DIM, max_position=16384, rope_parameters=params, dtype=torch.bfloat16).cuda()


def test_flash_cache_round_trip():
    layer, shape = flash_layer()
    cache = torch.zeros(shape, dtype=torch.bfloat16, device="cuda")

    def write(k, v, c, s):
        layer.impl.do_kv_cache_update(layer, k, v, c, s)

    layout = PageLayout.calibrate(cache, BLOCKS, BS, HEADS, DIM, write)
    assert all(i.is_cuda for i in layout.key_index)
    slots = torch.randperm(BLOCKS * BS, device="cuda")[:100]
    key = torch.randn(100, HEADS, DIM, device="cuda").bfloat16()
    value = torch.randn(100, HEADS, DIM, device="cuda").bfloat16()
    write(key, value, cache, slots)
    got_k, got_v = layout.gather(cache, slots)
    assert torch.equal(got_k, key) and torch.equal(got_v, value)


def test_rotary_kernel_on_cuda_matches_the_reference(rope):
    fast, reference = KeyRotator(rope), KeyRotator(rope, use_kernel=False)
    key = torch.randn(LAYERS, 64, HEADS, DIM, device="cuda")
    pos = torch.randint(0, 16000, (64,), device="cuda")
    assert torch.allclose(fast.rotate(key, pos), reference.rotate(key, pos), atol=1e-4)
    assert torch.allclose(fast.unrotate(key, pos), reference.unrotate(key, pos), atol=1e-4)


def test_worker_encode_then_inject_round_trips_on_cuda(tmp_path, rope):
    from kvmem.connector.plan import ConnectorMeta, LoadJob, SaveJob, Span
    from kvmem.connector.worker_side import WorkerSide

    layer, shape = flash_layer()
    side = WorkerSide(KVStore(tmp_path, "c" * 64), KeyRotator(rope), BS, BLOCKS, HEADS, DIM, torch.float32, None,
                      {name: layer for name in NAMES})
    caches = {name: torch.zeros(shape, dtype=torch.bfloat16, device="cuda") for name in NAMES}
    side.register_kv_caches(caches)
    assert side._stream.is_async and side._staging is not None
    n = 40
    pre_k = torch.randn(LAYERS, n, HEADS, DIM, device="cuda")
    value = torch.randn(LAYERS, n, HEADS, DIM, device="cuda").bfloat16()
    enc_pos, enc_blocks = torch.arange(7, 7 + n), (3, 9, 1, 4)
    srv_pos, srv_blocks = torch.arange(50, 50 + n), (0, 2, 5, 6, 7)
    cached_k = side.rotator.rotate(pre_k, enc_pos.cuda()).bfloat16()
    enc_slots = slot_mapping(enc_blocks, enc_pos, BS).cuda()
    for i, name in enumerate(NAMES):
        layer.impl.do_kv_cache_update(layer, cached_k[i], value[i], caches[name], enc_slots)
    side.save(ConnectorMeta(saves=[SaveJob("enc", enc_blocks, (Span("f", 7, n),), (tuple(range(n)),))]))
    assert side.finished({"enc"}) == {"enc"}
    side._writer.flush()
    blob = side.store.get("f")
    assert torch.allclose(blob.key, pre_k.cpu(), rtol=2**-7, atol=3e-2)
    side.load(ConnectorMeta(loads=[LoadJob("srv", srv_blocks, (Span("f", 50, n),))]))
    for name in NAMES:
        side.wait_layer(name)  # the current stream now waits for each layer's event
    assert not side.failed_block_ids
    got_k, got_v = side.gather(slot_mapping(srv_blocks, srv_pos, BS))
    assert torch.equal(got_k, side.rotator.rotate(blob.key.cuda(), srv_pos.cuda()).bfloat16().cpu())
    assert torch.equal(got_v, value.cpu())
    side.close()
