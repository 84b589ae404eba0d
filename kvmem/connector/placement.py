"""Placing one step's staged blob KV where the request serves it, layer by layer.

Runs in vLLM's worker process, on the paged cache's device (worker_side.py calls it). A staged
token's key was cached at the position it was encoded at; where it is served elsewhere, the key
is moved there (rope.py). The facts of a chat that reads with the reader adapter also go through
its KV map (reader/kvmap.py): keys and values, in float32, after the move (the map commutes with
RoPE, so the order is the lab's), unless they were staged mapped already (mapped_tier.py).

What does not depend on the layer is decided once per step (`Placement.of`): which rows move and
which are mapped, as runs of consecutive rows, and each rotary embedding's move rows. Runs, not
an index: a step stages the prompt's head (which stays put and is never mapped) before the facts
(which move and are mapped), so each set is one or a few runs, and a gather plus a scatter per
layer cost more than the work itself (on the CPU backend at k=50 they made the step's injection
take about twice as long; docs/benchmarks.md, "The KV map's TTFT cost").
Per layer (`Placement.layer`), a layer none of whose rows move or are mapped is only cast to the
cache dtype, bit for bit as stored; otherwise its key is worked on in one float32 copy and
rounded once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvmem.connector.rope import LayerRotators, rotary_kernel
from kvmem.connector.staging import HostStaging
from kvmem.reader.kvmap import KVMap, rotate_half


@dataclass(frozen=True)
class DeviceKVMap:
    """The reader's KV map on the cache's device, in float32, as the worker applies it.

    Its key map is a complex multiply per head and rotary pair, k -> (a + ib) k, which is what a
    rotary kernel does per token with its cos/sin rows: with each (token, head) as a "token" and
    its head as its "position", one call of the engine's fused kernel (rope.rotary_kernel) maps a
    layer's keys in place, about 5x faster than the five torch ops it replaces on the CPU backend.
    The pairs past a partial rotary_dim, and builds without the kernel, take the torch ops."""

    rows: torch.Tensor  # [L, H, R]: per layer, one kernel row per head, the R/2 pairs' a then b
    a: torch.Tensor  # [L, H, D]: the same factors spread to both dims of every pair (torch path)
    b: torch.Tensor  # [L, H, D]
    scale: torch.Tensor  # [L, H, D]
    shift: torch.Tensor  # [L, H, D]
    rotary_dim: int | None
    kernel: Callable | None

    @classmethod
    def on(cls, kv_map: KVMap, device: torch.device) -> "DeviceKVMap":
        m = kv_map.to(device, torch.float32)
        r = (m.rotary_dim or m.shape[2]) // 2
        rows = torch.cat((m.key_a[..., :r], m.key_b[..., :r]), dim=-1).contiguous()
        return cls(rows, *m.key_factors(), m.value_scale, m.value_shift, m.rotary_dim, rotary_kernel())

    def keys_(self, k: torch.Tensor, layer: int | None = None) -> None:
        """k [M, H, D] of layer `layer`, or [L, M, H, D] of every layer (layer None), contiguous
        float32, through the key map in place: k a + swap(k) b."""
        keys = k if layer is None else k[None]  # [l, M, H, D]
        rows, a, b = (t if layer is None else t[layer][None] for t in (self.rows, self.a, self.b))  # [l, H, .]
        layers, tokens, heads, dim = keys.shape
        r = self.rotary_dim or dim
        if self.kernel is not None:
            # [l*M*H]: each (layer, token, head) row's kernel row, its layer's row for its head
            which = (torch.arange(layers, device=k.device)[:, None, None] * heads
                     + torch.arange(heads, device=k.device)).expand(layers, tokens, heads).reshape(-1)
            self.kernel(which, keys.view(-1, dim), None, dim, rows.reshape(layers * heads, r), True)
        else:
            _mul_pairs_(keys[..., :r], a[:, None, :, :r], b[:, None, :, :r])
        if r < dim:  # the pairs past the rotary dims (kvmap.pair_swap)
            _mul_pairs_(keys[..., r:], a[:, None, :, r:], b[:, None, :, r:])

    def values_(self, v: torch.Tensor, layer: int | None = None) -> None:
        """v [M, H, D] of layer `layer`, or [L, M, H, D] of every layer, float32, through the
        value map in place."""
        scale, shift = (t[layer] if layer is not None else t[:, None] for t in (self.scale, self.shift))
        v.mul_(scale).add_(shift)


def _mul_pairs_(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """x [..., 2P] (neox pairs: dims i and i + P) -> x a + rotate_half(x) b, in place (x may be a view)."""
    x.copy_(x * a + rotate_half(x) * b)


@dataclass(frozen=True)
class Placement:
    """One step's placement: what `layer` does to every layer's staged K/V."""

    moves: tuple[tuple[slice, tuple[torch.Tensor, ...]], ...]  # (run, its move rows per layer [len, rot])
    mapped: tuple[slice, ...]  # runs through the KV map
    rotator: LayerRotators
    kv_map: DeviceKVMap | None

    @classmethod
    def of(cls, src: torch.Tensor, dst: torch.Tensor, mapped: torch.Tensor | None, rotator: LayerRotators,
           kv_map: DeviceKVMap | None, device: torch.device) -> "Placement":
        """src [N] where each staged key was cached (-1: pre-RoPE), dst [N] where it is served,
        mapped [N] bool or None (host tensors) -> the step's placement on `device`."""
        runs = _runs(src != dst)
        moves = ()
        if runs:
            moving = torch.cat([torch.arange(r.start, r.stop) for r in runs])
            shared: dict[int, torch.Tensor] = {}  # layers that share a rotary embedding share its rows
            for rot in rotator.per_layer:
                if id(rot) not in shared:
                    shared[id(rot)] = rot.move_rows(src[moving], dst[moving], device)  # [M, rot]
            rows = [shared[id(rot)] for rot in rotator.per_layer]
            at = [0]
            for r in runs:
                at.append(at[-1] + r.stop - r.start)
            moves = tuple((r, tuple(t[at[j]:at[j + 1]] for t in rows)) for j, r in enumerate(runs))
        mapped_runs = _runs(mapped) if mapped is not None and kv_map is not None else ()
        return cls(moves, mapped_runs, rotator, kv_map if mapped_runs else None)

    def layer(self, i: int, key: torch.Tensor, value: torch.Tensor,
              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's staged key, value [N, H, D] (decoded; possibly the staging buffer itself,
        which is only read) -> as the cache takes them, in `dtype`."""
        if not self.moves and not self.mapped:
            return key.to(dtype), value.to(dtype)
        k = key.to(torch.float32, copy=True)  # [N, H, D]
        for run, rows in self.moves:
            self.rotator.per_layer[i].apply_rows(k[run][None], rows[i])  # a run's rows are contiguous
        if not self.mapped:
            return k.to(dtype), value.to(dtype)
        v = value.to(torch.float32, copy=True)
        for run in self.mapped:
            self.kv_map.keys_(k[run], i)
            self.kv_map.values_(v[run], i)
        return k.to(dtype), v.to(dtype)

    def all_layers(self, key: torch.Tensor, value: torch.Tensor, dtype: torch.dtype,
                   work: HostStaging | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer's staged key, value [L, N, H, D] at once -> as the caches take them, in
        `dtype`: what `layer` gives for each layer, with one op per pass over all layers where
        `layer` makes one per layer (on the CPU backend those ~90 small ops were a quarter of the
        placement at k=50: scripts/placement_passes.py). The inputs are only read.

        `work`: buffers kept across steps for the float32 keys and the rounded ones (valid until
        the next step's placement). Fresh tensors of that size come from the OS each time, page
        by page: at k=100 the float32 copy took ~10 ms where the copy itself takes ~3."""
        if self.mapped:  # the map in the step (a blob the mapped tier has not seen yet): layer by layer
            pairs = [self.layer(i, key[i], value[i], dtype) for i in range(len(key))]
            return torch.stack([k for k, _ in pairs]), torch.stack([v for _, v in pairs])
        if not self.moves:
            return key.to(dtype), value.to(dtype)
        if work is None:
            k, rounded = key.to(torch.float32, copy=True), None  # [L, N, H, D]
        else:
            k, rounded = work.take([(tuple(key.shape), torch.float32), (tuple(key.shape), dtype)])
            k.copy_(key)
        rot = self.rotator.per_layer
        (run, rows), = self.moves if len(self.moves) == 1 else ((None, None),)
        if run == slice(0, k.shape[1]) and all(r is rot[0] for r in rot):  # every row moves, one rotary embedding
            rot[0].apply_rows(k, rows[0])  # one kernel call: layers act as extra tokens
        else:
            for i in range(len(rot)):
                for run, rows in self.moves:
                    rot[i].apply_rows(k[i, run][None], rows[i])
        return k.to(dtype) if rounded is None else rounded.copy_(k), value.to(dtype)


def _runs(rows: torch.Tensor) -> tuple[slice, ...]:
    """rows [N] bool -> its runs of consecutive True rows, as slices."""
    edge = torch.nn.functional.pad(rows.to(torch.int8), (1, 1)).diff()  # [N + 1]: +1 a run starts, -1 it ends
    starts = (edge == 1).nonzero().flatten().tolist()
    ends = (edge == -1).nonzero().flatten().tolist()
    return tuple(slice(s, e) for s, e in zip(starts, ends))
