"""Attention for recomputed rows over the paged cache: the engine's own kernel where it has one.

Runs in vLLM's worker process, inside `start_load_kv` (kvmem/connector/recompute.py drives the
layers). A recompute's chosen tokens attend, causally, to every slot of their request up to
themselves: the injected K/V and the K/V the same layer has just rewritten.

Two ways to compute that, chosen per attention layer at start-up (`attention_for`):

- `EngineKernel` (vLLM's CPU backend): the chosen rows are cut into runs of consecutive prompt
  positions, and each run is handed to `cpu_attention_with_kv_cache` as if it were the tail of a
  request of its own (its queries the last `len(run)` positions of a sequence ending at the run's
  end, over the request's block table). That is the call vLLM makes for a prefill chunk over a
  cached prefix, so recomputing every fact token reproduces text prefill wherever the engine's own
  prefix-cache hit does (bit for bit on hosts whose kernels are row-independent), and it costs one
  fused kernel call per layer instead of a gather and a masked float32 attention per request.
- `GatheredAttention` (any device; CUDA until its varlen kernel is driven): gathers each request's
  context out of the pages and runs torch's fused attention in float32 under a causal mask.
"""

from __future__ import annotations

import torch

from kvmem.connector.paged import PageLayout, slot_mapping


class Chosen:
    """The rows a layer recomputes: their slots, positions and owners (request of each row)."""

    def __init__(self, slots: torch.Tensor, positions: torch.Tensor, owner: torch.Tensor,
                 blocks: list[tuple[int, ...]], ends: list[int], block_size: int) -> None:
        self.slots = slots  # [M] paged slots, on the device
        self.positions = positions  # [M] prompt positions, on the device
        self.owner = owner  # [M] index of each row's request (into blocks/ends), on the device
        self.blocks = blocks  # per request: its block ids in prompt order
        self.ends = ends  # per request: its injected end (positions 0..end-1 are in its pages)
        self.block_size = block_size


class EngineKernel:
    """Recomputed rows through vLLM CPU's paged attention kernel, as runs of consecutive positions.

    The per-run metadata (query start offsets, sequence lengths, block table, the kernel's work
    schedule) is the same in every layer that shares heads and window: built once per shape."""

    def __init__(self, chosen: Chosen, group_window: int) -> None:
        from vllm import envs

        positions, owner = chosen.positions.tolist(), chosen.owner.tolist()
        starts, seq_lens, table_rows = [], [], []
        for j, (p, r) in enumerate(zip(positions, owner)):
            if j == 0 or r != owner[j - 1] or p != positions[j - 1] + 1:  # a new run
                starts.append(j)
                seq_lens.append(p + 1)
                table_rows.append(r)
            else:
                seq_lens[-1] = p + 1
        width = max(len(b) for b in chosen.blocks)
        tables = torch.zeros(len(chosen.blocks), width, dtype=torch.int32)
        for r, blocks in enumerate(chosen.blocks):
            tables[r, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        self.slots, self.positions = chosen.slots, chosen.positions  # [M] each
        self.query_start_loc = torch.tensor(starts + [len(positions)], dtype=torch.int32)  # [R+1]
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32)  # [R]
        self.block_table = tables[torch.tensor(table_rows, dtype=torch.long)]  # [R, W]
        self.group_window, self.split_kv = group_window, bool(envs.VLLM_CPU_ATTN_SPLIT_KV)
        self._schedules: dict[tuple, torch.Tensor] = {}

    def schedule(self, attn, dtype: torch.dtype) -> torch.Tensor:
        """The kernel's work split for this layer's shape, as the engine's metadata builder makes it."""
        from vllm import _custom_ops as ops

        impl = attn.impl
        key = (impl.num_heads, impl.num_kv_heads, attn.head_size, dtype, attn.isa, impl.kv_cache_dtype)
        if key not in self._schedules:
            self._schedules[key] = ops.cpu_attn_get_scheduler_metadata(
                num_reqs=len(self.seq_lens), num_heads=impl.num_heads, num_kv_heads=impl.num_kv_heads,
                head_dim=attn.head_size, seq_lens=self.seq_lens, dtype=dtype,
                query_start_loc=self.query_start_loc, causal=True, sliding_window_size=self.group_window,
                isa=attn.isa, enable_kv_split=self.split_kv, kv_cache_dtype=impl.kv_cache_dtype)
        return self._schedules[key]

    def forward(self, attn, cache: torch.Tensor):
        """The attention layer's forward for these rows: (query, key, value) -> [M, Hq * Dv]."""
        from vllm import _custom_ops as ops

        def forward(query, key, value, *args, **kwargs):
            impl = attn.impl
            q = query.view(-1, attn.num_heads, attn.head_size)  # [M, Hq, D], rows strided as the engine's
            k = key.view(-1, attn.num_kv_heads, attn.head_size)
            v = value.view(-1, attn.num_kv_heads, attn.head_size_v)
            impl.do_kv_cache_update(attn, k, v, cache, self.slots)
            out = query.new_empty(q.shape[0], attn.num_heads, attn.head_size_v)
            blocks, heads, block_size, _ = cache.shape  # [blocks, Hkv, block, 2 * D]
            key_cache, value_cache = cache.view(blocks, heads, block_size * 2, -1).chunk(2, dim=2)
            ops.cpu_attention_with_kv_cache(
                query=q, key_cache=key_cache, value_cache=value_cache, output=out,
                query_start_loc=self.query_start_loc, seq_lens=self.seq_lens, scale=impl.scale, causal=True,
                alibi_slopes=impl.alibi_slopes, sliding_window=impl.sliding_window, block_table=self.block_table,
                softcap=impl.logits_soft_cap, scheduler_metadata=self.schedule(attn, q.dtype), s_aux=impl.sinks,
                k_scale=attn._k_scale_float, v_scale=attn._v_scale_float, kv_cache_dtype=impl.kv_cache_dtype)
            return out.view(q.shape[0], -1)

        return forward


class GatheredAttention:
    """Recomputed rows attending to their requests' slots 0..E-1 gathered out of the pages, causally
    (and within a sliding window), in float32 with torch's fused attention. Any device."""

    def __init__(self, chosen: Chosen, layout: PageLayout, shape: torch.Size) -> None:
        self.slots, self.positions = chosen.slots, chosen.positions  # [M] each
        self.parts = []  # per request: (its rows [m] among the chosen, their positions [m], 0..E-1 [E], coords of E)
        device = chosen.slots.device
        for r, (blocks, end) in enumerate(zip(chosen.blocks, chosen.ends)):
            mine = (chosen.owner == r).nonzero().squeeze(1)
            if len(mine):
                context = slot_mapping(blocks, torch.arange(end), chosen.block_size).to(device)
                keys = torch.arange(end, device=device)
                self.parts.append((mine, chosen.positions[mine], keys, layout.coords(context, shape)))
        self.layout = layout

    def forward(self, attn, cache: torch.Tensor):
        w = attn.sliding_window
        window = w if isinstance(w, int) and w > 0 else None
        cap = getattr(attn.impl, "logits_soft_cap", None) or None

        def forward(query, key, value, *args, **kwargs):
            m = query.shape[0]
            q = query.view(m, attn.num_heads, attn.head_size)  # [M, Hq, D]
            k, v = key.view(m, attn.num_kv_heads, attn.head_size), value.view(m, attn.num_kv_heads, attn.head_size_v)
            attn.impl.do_kv_cache_update(attn, k, v, cache, self.slots)
            out = query.new_empty(m, attn.num_heads, attn.head_size_v)
            for mine, positions, keys, coords in self.parts:
                seen = keys[None] <= positions[:, None]  # [m, E]
                if window is not None:
                    seen &= positions[:, None] - keys[None] < window
                k_all, v_all = self.layout.read(cache, coords)
                out[mine] = _attend(attn, cap, q[mine], seen, k_all, v_all).to(out.dtype)
            return out.view(m, -1)

        return forward


def _attend(attn, cap, q: torch.Tensor, seen: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [m, Hq, D] over k, v [E, Hkv, D] where seen [m, E] -> [m, Hq, Dv], float32 math."""
    q, k, v = (t.float().transpose(0, 1) for t in (q, k, v))  # [H, m|E, D]
    if cap is None:  # one fused kernel; grouped-query heads shared without copies
        out = torch.nn.functional.scaled_dot_product_attention(
            q[None], k[None], v[None], attn_mask=seen[None, None], scale=attn.impl.scale,
            enable_gqa=attn.num_heads != attn.num_kv_heads)[0]
    else:  # Gemma 2's soft cap on the scores: no fused kernel has it
        group = attn.num_heads // attn.num_kv_heads
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
        scores = cap * torch.tanh(torch.einsum("hmd,hed->hme", q, k) * attn.impl.scale / cap)
        out = torch.einsum("hme,hed->hmd", scores.masked_fill(~seen[None], float("-inf")).softmax(-1), v)
    return out.transpose(0, 1)


def engine_kernel_serves(attention: list[torch.nn.Module]) -> bool:
    """Whether every layer runs on vLLM's CPU backend, whose kernel `EngineKernel` drives."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    except ImportError:
        return False
    return all(isinstance(a.impl, CPUAttentionBackendImpl) for a in attention)


def group_window(attention: list[torch.nn.Module]) -> int:
    """The sliding window every layer shares, else -1: what the engine's CPU metadata builder
    gives its kernel's work schedule (one KV cache group for all layers)."""
    windows = {a.impl.sliding_window for a in attention}
    return windows.pop() if len(windows) == 1 else -1
