"""Reading K/V back out of vLLM's paged cache, whatever the backend's layout.

Writes always go through the backend's own `do_kv_cache_update`. For reads we do not hard-code
a layout (CPU pages hold K transposed as [D, block] then V as [block, D]; CUDA flash-attention
keeps [2, blocks, block, H, D]; AMX or fp8 paths differ again). Instead `PageLayout.calibrate`
writes probe K/V whose values encode (token, head, dim) into a 2-block scratch cache through the
backend's op, and reads off where each element landed. Gathers are then one advanced-indexing
read per layer. Verified on the CPU backend by a round-trip test; CUDA uses the same code path
but has not been run here (no GPU on these machines).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

# write(key [T, H, D], value [T, H, D], cache, slot_mapping [T]) -> None
CacheWriter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]

_DIGIT = 16  # probe values stay small integers, exact in fp16/bf16


@dataclass(frozen=True)
class PageLayout:
    block_dim: int  # which cache dimension indexes blocks
    block_size: int
    key_index: tuple[torch.Tensor, ...]  # per cache dim: [block_size, H, D] coordinates in block 0
    value_index: tuple[torch.Tensor, ...]

    @classmethod
    def calibrate(cls, cache: torch.Tensor, num_blocks: int, block_size: int, num_kv_heads: int,
                  head_size: int, write: CacheWriter) -> "PageLayout":
        if cache.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise NotImplementedError(f"kvmem cannot read a {cache.dtype} KV cache (quantized caches unsupported)")
        block_dim = list(cache.shape).index(num_blocks)
        shape = list(cache.shape)
        shape[block_dim] = 2
        scratch = torch.zeros(shape, dtype=cache.dtype, device=cache.device)
        t, h, d = torch.meshgrid(torch.arange(block_size), torch.arange(num_kv_heads),
                                 torch.arange(head_size), indexing="ij")  # each [B, H, D]
        slots = torch.arange(block_size, device=cache.device)
        digits = [c // _DIGIT ** i % _DIGIT for c in (t, h, d) for i in range(_digits(max(block_size, num_kv_heads, head_size)))]
        readings = []
        for probe in digits:
            scratch.zero_()
            k = (probe + 1).to(cache.dtype).to(cache.device)
            write(k, -k, scratch, slots)
            readings.append(scratch.clone())
        where = readings[0] != 0  # every written element, K positive and V negative
        if int(where.sum()) != 2 * block_size * num_kv_heads * head_size:
            raise RuntimeError("KV cache layout calibration failed: probe writes did not land one-to-one")
        coords = where.nonzero(as_tuple=True)  # per dim: [2*B*H*D]
        values = [r[where].float() for r in readings]
        is_key = values[0] > 0
        n = len(digits) // 3
        decoded = [sum((values[j * n + i].abs() - 1) * _DIGIT ** i for i in range(n)).long() for j in range(3)]
        return cls(block_dim, block_size,
                   _index_by_thd(coords, decoded, is_key, (block_size, num_kv_heads, head_size)),
                   _index_by_thd(coords, decoded, ~is_key, (block_size, num_kv_heads, head_size)))

    def gather(self, cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """slots [N] -> key, value, each [N, H, D], copied out of one layer's paged cache."""
        slots = slots.to(torch.long)
        block, offset = slots // self.block_size, slots % self.block_size
        return self._read(cache, self.key_index, block, offset), self._read(cache, self.value_index, block, offset)

    def _read(self, cache, index, block, offset) -> torch.Tensor:
        coords = [idx.to(cache.device)[offset] for idx in index]  # each [N, H, D]
        coords[self.block_dim] = block.to(cache.device)[:, None, None].expand_as(coords[0])
        return cache[tuple(coords)]


def _digits(largest: int) -> int:
    n = 1
    while _DIGIT**n < largest:
        n += 1
    return n


def _index_by_thd(coords, decoded, mask, shape) -> tuple[torch.Tensor, ...]:
    t, h, d = (x[mask] for x in decoded)
    out = []
    for c in coords:
        idx = torch.full(shape, -1, dtype=torch.long)
        idx[t, h, d] = c[mask].cpu()
        out.append(idx)
    if (out[0] < 0).any():
        raise RuntimeError("KV cache layout calibration failed: some (token, head, dim) never landed")
    return tuple(out)
