"""The layout-calibrated gather reads back exactly what the CPU backend's own op wrote."""

import pytest
import torch

from kvmem.connector.paged import PageLayout
from tests.connector.backend import cpu_cache_writer


@pytest.mark.cpu_backend
@pytest.mark.parametrize("block_size", [32, 128])
def test_cpu_cache_round_trip(block_size, model_dir):
    heads, dim, blocks = 3, 64, 6
    write, _ = cpu_cache_writer(str(model_dir), block_size, dim)
    cache = torch.zeros(blocks, heads, block_size, 2 * dim, dtype=torch.bfloat16)  # CPU layout
    _assert_round_trip(cache, write, blocks, block_size, heads, dim, tokens=150, seed=block_size)


def _assert_round_trip(cache, write, blocks, block_size, heads, dim, tokens, seed):
    """Calibrate, write random K/V at random slots with the backend's op, gather them back."""
    layout = PageLayout.calibrate(cache, blocks, block_size, heads, dim, write)
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(blocks * block_size, generator=g)[:tokens]
    key = torch.randn(tokens, heads, dim, generator=g).to(cache.dtype)
    value = torch.randn(tokens, heads, dim, generator=g).to(cache.dtype)
    write(key, value, cache, slots)
    got_k, got_v = layout.gather(cache, slots)
    assert torch.equal(got_k, key) and torch.equal(got_v, value)
    # The flat offsets selective recompute reads through (computed once, then one take per layer).
    flat_k, flat_v = layout.read(cache, layout.coords(slots, cache.shape))
    assert torch.equal(flat_k, key) and torch.equal(flat_v, value)


@pytest.mark.cpu_backend
@pytest.mark.parametrize("offset", [5, 21, 30])
def test_cpu_page_is_transposed_key_then_value(model_dir, offset):
    """Pins the layouts the CPU backend writes, per (block, head) page: K as [D, block] then V as
    [block, D] (DESIGN.md), or, where vLLM picks its AMX kernels, AMX tiles (pinned below)."""
    bs, heads, dim = 32, 3, 64
    write, isa = cpu_cache_writer(str(model_dir), bs, dim)
    cache = torch.zeros(2, heads, bs, 2 * dim, dtype=torch.bfloat16)
    key = torch.randn(1, heads, dim).to(torch.bfloat16)
    value = torch.randn(1, heads, dim).to(torch.bfloat16)
    write(key, value, cache, torch.tensor([bs + offset]))  # block 1
    page = cache.view(2, heads, 2 * bs * dim)[1]
    if isa == "amx":
        key_at, value_at = _amx_positions(offset, bs, dim)
        assert torch.equal(page[:, key_at], key[0]) and torch.equal(page[:, value_at], value[0])
        return
    assert torch.equal(page[:, : bs * dim].view(heads, dim, bs)[:, :, offset], key[0])
    assert torch.equal(page[:, bs * dim :].view(heads, bs, dim)[:, offset], value[0])


def _amx_positions(offset: int, bs: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the AMX layout puts one token's K and V dims within a (block, head) page: K in tiles
    of 16 tokens, each [D/2, 16, 2] (dim pairs interleaved per token); then V as [D/16, bs/2, 16, 2]
    (16-dim chunks, token pairs interleaved per dim)."""
    d = torch.arange(dim)
    key = (offset // 16) * 16 * dim + (d // 2) * 32 + (offset % 16) * 2 + d % 2
    value = bs * dim + (d // 16) * bs * 16 + (offset // 2) * 32 + (d % 16) * 2 + offset % 2
    return key, value


def test_quantized_cache_is_refused():
    cache = torch.zeros(2, 1, 32, 16, dtype=torch.uint8)
    with pytest.raises(NotImplementedError):
        PageLayout.calibrate(cache, 2, 32, 1, 8, lambda *a: None)


def _flash_writer(hnd: bool):
    """The layouts of vLLM's CUDA backends, written in torch: [2, blocks, block, H, D] (flash-attn,
    reshape_and_cache_flash) or [2, blocks, H, block, D] (FlashInfer's HND). No GPU here, so this
    pins the calibration logic those layouts go through, not the CUDA kernels themselves."""

    def write(key, value, cache, slots):
        bs = cache.shape[3] if hnd else cache.shape[2]
        block, offset = slots // bs, slots % bs
        for i, (b, o) in enumerate(zip(block.tolist(), offset.tolist())):
            if hnd:
                cache[0, b, :, o], cache[1, b, :, o] = key[i], value[i]
            else:
                cache[0, b, o], cache[1, b, o] = key[i], value[i]

    return write


@pytest.mark.parametrize("hnd", [False, True])
def test_cuda_style_layouts_round_trip(hnd):
    heads, dim, blocks, bs = 3, 64, 5, 16
    shape = (2, blocks, heads, bs, dim) if hnd else (2, blocks, bs, heads, dim)
    _assert_round_trip(torch.zeros(shape, dtype=torch.float16), _flash_writer(hnd), blocks, bs, heads, dim,
                       tokens=40, seed=int(hnd))
