"""The worker side on a simulated second device (simdevice.py): every tensor op must run on the
paged cache's device, as on a GPU, and encode -> blob -> inject must still round-trip exactly.

The first two tests are the two crash paths of the first CUDA-unaware version: the layout
calibration indexed a host tensor with device indices, and encoding moved keys to the host and
un-rotated them there with a kernel the CUDA build registers for CUDA tensors only.
"""

import pytest
import torch

from kvmem.engine.paged import PageLayout
from kvmem.engine.rope import KeyRotator
from kvmem.kv.store import KVStore
from tests.engine.backend import cpu_attention_layer, cpu_cache_writer
from tests.engine.simdevice import DeviceMismatch, OnDevice, SimulatedDevice, to_device, to_host

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


def worker(tmp_path, rope, model_dir):
    from kvmem.engine.worker_side import WorkerSide

    layer = cpu_attention_layer(str(model_dir), BS, DIM)
    return WorkerSide(KVStore(tmp_path, FP), KeyRotator(rope), BS, BLOCKS, HEADS, DIM, torch.float32, None,
                      {name: layer for name in NAMES})


def test_encode_then_inject_on_the_device_round_trips(tmp_path, rope, model_dir):
    from kvmem.engine.paged import slot_mapping
    from kvmem.engine.plan import ConnectorMeta, LoadJob, SaveJob, Span

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
    assert blob.token_ids == tuple(range(n)) and blob.key.dtype == torch.float32
    # Un-rotating the bf16 cached keys on the device recovers the pre-RoPE keys to bf16 precision.
    assert torch.allclose(blob.key, pre_k, rtol=2**-7, atol=2e-2)
    assert torch.equal(blob.value, value)
    # Injected at other positions: exactly the blob rotated there, rounded to the cache dtype.
    assert torch.equal(got_k, rotator.rotate(blob.key, srv_pos).to(torch.bfloat16))
    assert torch.equal(got_v, value)


def test_a_failed_injection_reports_blocks_instead_of_raising(tmp_path, rope, model_dir):
    from kvmem.engine.plan import ConnectorMeta, LoadJob, Span

    side = worker(tmp_path, rope, model_dir)
    with SimulatedDevice():
        side.register_kv_caches({name: to_device(empty_cache()) for name in NAMES})
        side.load(ConnectorMeta(loads=[LoadJob("r", (1, 3), (Span("absent", 30, 10),))]))
    assert side.failed_block_ids == {1, 3}
