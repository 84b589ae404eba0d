"""Reading K/V back out of vLLM's paged cache, whatever the backend's layout.

Writes always go through the backend's own `do_kv_cache_update`. For reads we do not hard-code
a layout (CPU pages hold K transposed as [D, block] then V as [block, D]; CUDA flash-attention
keeps [2, blocks, block, H, D]; FlashInfer's HND [2, blocks, H, block, D]). Instead
`PageLayout.calibrate` writes probe K/V whose values encode (token, head, dim) into a 2-block
scratch cache through the backend's op, and reads off where each element landed. Gathers are
then one advanced-indexing read per layer, with index tensors that live on the cache's device.

Calibration is the one place that reads cache contents on the host: the probe readings are
copied out once at start-up and decoded there; everything a gather needs afterwards stays on
the device (no host round trip, no per-call upload).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

# write(key [T, H, D], value [T, H, D], cache, slot_mapping [T]) -> None
CacheWriter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]

_DIGIT = 16  # probe values stay small integers, exact in fp16/bf16


@dataclass(frozen=True)
class PageLayout:
    block_dim: int  # which cache dimension indexes blocks
    block_size: int
    key_index: tuple[torch.Tensor, ...]  # per cache dim: [block_size, H, D] coordinates in block 0, on the cache's device
    value_index: tuple[torch.Tensor, ...]

    @classmethod
    def calibrate(cls, cache: torch.Tensor, num_blocks: int, block_size: int, num_kv_heads: int,
                  head_size: int, write: CacheWriter) -> "PageLayout":
        if cache.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise NotImplementedError(f"kvmem cannot read a {cache.dtype} KV cache (quantized caches unsupported)")
        block_dim = list(cache.shape).index(num_blocks)
        shape = (block_size, num_kv_heads, head_size)
        probes = _probes(shape)
        readings = _probe_readings(cache, block_dim, block_size, probes, write)  # host tensors
        where = readings[0] != 0  # every written element, K positive and V negative
        if int(where.sum()) != 2 * block_size * num_kv_heads * head_size:
            raise RuntimeError("KV cache layout calibration failed: probe writes did not land one-to-one")
        coords = where.nonzero(as_tuple=True)  # per dim: [2*B*H*D]
        values = [r[where].float() for r in readings]
        is_key = values[0] > 0
        n = len(probes) // 3
        decoded = [sum((values[j * n + i].abs() - 1) * _DIGIT**i for i in range(n)).long() for j in range(3)]
        return cls(block_dim, block_size,
                   _index_by_thd(coords, decoded, is_key, shape, cache.device),
                   _index_by_thd(coords, decoded, ~is_key, shape, cache.device))

    def gather(self, cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """slots [N] (int64, on the cache's device) -> key, value, each [N, H, D], copied out of one layer."""
        block, offset = slots // self.block_size, slots % self.block_size
        return (cache[tuple(self._coords(self.key_index, block, offset))],
                cache[tuple(self._coords(self.value_index, block, offset))])

    def coords(self, slots: torch.Tensor, shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
        """slots [N] -> where their keys and values lie in a layer's cache of `shape`, as
        row-major element offsets [N, H, D] (for `read`): the same in every layer, so a reader of
        many layers computes them once, and one `take` per read replaces a 4-way index."""
        block, offset = slots // self.block_size, slots % self.block_size
        return self._flat(self.key_index, block, offset, shape), self._flat(self.value_index, block, offset, shape)

    @staticmethod
    def read(cache: torch.Tensor, coords) -> tuple[torch.Tensor, torch.Tensor]:
        """-> key, value [N, H, D] at `coords` (from `coords`), copied out of one layer's cache."""
        return torch.take(cache, coords[0]), torch.take(cache, coords[1])

    def _coords(self, index, block, offset) -> list[torch.Tensor]:
        coords = [idx[offset] for idx in index]  # each [N, H, D]
        coords[self.block_dim] = block[:, None, None].expand_as(coords[0])
        return coords

    def _flat(self, index, block, offset, shape) -> torch.Tensor:
        coords = self._coords(index, block, offset)
        flat, step = torch.zeros_like(coords[0]), 1
        for dim in reversed(range(len(shape))):
            flat += coords[dim] * step
            step *= shape[dim]
        return flat


def slot_mapping(block_ids: Sequence[int], positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Prompt positions [N] of one request -> cache slots [N] (host int64 tensors)."""
    blocks = torch.tensor(block_ids, dtype=torch.long)
    return blocks[positions // block_size] * block_size + positions % block_size


def _probes(shape: tuple[int, int, int]) -> list[torch.Tensor]:
    """Base-16 digits of each element's token, head and dim index: 3 * n tensors of `shape`."""
    t, h, d = torch.meshgrid(*(torch.arange(s) for s in shape), indexing="ij")  # each [B, H, D]
    n = _digits(max(shape))
    return [c // _DIGIT**i % _DIGIT for c in (t, h, d) for i in range(n)]


def _probe_readings(cache, block_dim: int, block_size: int, probes, write: CacheWriter) -> list[torch.Tensor]:
    """Write each probe (K = digit + 1, V = -(digit + 1)) into a 2-block scratch cache on the
    cache's device with the backend's op; -> the scratch contents after each write, on the host."""
    shape = list(cache.shape)
    shape[block_dim] = 2
    scratch = torch.zeros(shape, dtype=cache.dtype, device=cache.device)
    slots = torch.arange(block_size, device=cache.device)
    readings = []
    for probe in probes:
        scratch.zero_()
        k = (probe + 1).to(device=cache.device, dtype=cache.dtype)
        write(k, -k, scratch, slots)
        readings.append(scratch.to("cpu", copy=True))  # .cpu() would alias a CPU scratch
    return readings


def _digits(largest: int) -> int:
    n = 1
    while _DIGIT**n < largest:
        n += 1
    return n


def _index_by_thd(coords, decoded, mask, shape, device) -> tuple[torch.Tensor, ...]:
    """Host coordinates of the masked elements -> per cache dim an index [B, H, D] on `device`."""
    t, h, d = (x[mask] for x in decoded)
    out = []
    for c in coords:
        idx = torch.full(shape, -1, dtype=torch.long)
        idx[t, h, d] = c[mask]
        out.append(idx)
    if (out[0] < 0).any():
        raise RuntimeError("KV cache layout calibration failed: some (token, head, dim) never landed")
    return tuple(idx.to(device) for idx in out)
