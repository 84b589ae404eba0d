"""Selective recompute inside the worker: chosen fact tokens computed again over the injected cache.

Runs in vLLM's worker process, in `start_load_kv`, after a step's blobs are written into the
paged cache and before the engine's forward pass (outside CUDA graphs). For the tokens that
kv/recompute.py chooses, it runs the model's own decoder layers, one after another: their hidden
states start from the embedding; at each layer their new K/V are written into their paged slots,
then their queries attend, causally, to every slot of their request up to the injected end.
Only the chosen tokens are carried from layer to layer (CacheBlend's scheme), so the cost is
their share of a prefill; tokens the engine then computes read the corrected cache.

The layers run unchanged: for the duration, each attention layer's `forward` is swapped for one
that does the write and the gathered attention itself (eager torch; the backend's kernels only
know vLLM's own batch metadata). Model structures this cannot drive are refused once, at
start-up, with the reason (`Recomputer.find`); the connector then injects without recompute.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import logging
import warnings
from dataclasses import dataclass

import torch

from kvmem.connector.paged import PageLayout, slot_mapping
from kvmem.kv.recompute import Recompute, key_deviation, positional, top_per_fact

log = logging.getLogger("kvmem.connector")


@dataclass(frozen=True)
class Rows:
    """One step's recompute: the requests' candidate fact tokens, request after request."""

    ids: torch.Tensor  # [N] token ids, on the device
    positions: torch.Tensor  # [N] prompt positions, on the device
    slots: torch.Tensor  # [N] their paged slots, on the device
    request: list[tuple[int, int]]  # per request: (its first row, its row count), in row order
    context: list[torch.Tensor]  # per request: slots [E] of its positions 0..E-1 (E = the injected end), on the device
    lengths: list[int]  # per fact (span), its candidate count, in row order
    rec: Recompute  # the requests' common setting

    @classmethod
    def of_jobs(cls, members: list, rec: Recompute, token_ids: torch.Tensor, positions: torch.Tensor,
                slots: torch.Tensor, block_size: int, device: torch.device) -> "Rows | None":
        """The fact tokens of these load jobs as rows. members: (job, index of its first token
        in the step's staging order); token_ids, positions, slots: [N] host tensors in that
        order. The head (the segment at prompt position 0) is never recomputed."""
        index, request, context, lengths, first = [], [], [], [], 0
        for job, at in members:
            mine = 0
            for span in job.spans:
                if span.start - span.src > 0:  # a fact, not the head
                    index.append(torch.arange(at, at + span.length))
                    lengths.append(span.length)
                    mine += span.length
                at += span.length
            if mine:
                request.append((first, mine))
                first += mine
                end = max(s.end for s in job.spans)
                context.append(slot_mapping(job.block_ids, torch.arange(end), block_size).to(device))
        if not index:
            return None
        index = torch.cat(index)
        return cls(ids=token_ids[index].to(device), positions=positions[index].to(device),
                   slots=slots[index].to(device), request=request, context=context, lengths=lengths, rec=rec)


class Recomputer:
    """The model's embedding and decoder layers, as the recompute drives them."""

    def __init__(self, embed, layers: list[torch.nn.Module], attention: list[torch.nn.Module],
                 names: list[str]) -> None:
        self.embed = embed  # token ids [N] -> hidden [N, hidden]
        self.layers = layers  # decoder layers in cache order: (positions, hidden, residual) -> (hidden, residual)
        self.attention = attention  # each layer's attention module (static forward context)
        self.names = names  # their names, in that order

    @classmethod
    def find(cls, attention_by_name: dict[str, torch.nn.Module], names: list[str],
             modules: list[torch.nn.Module]) -> "Recomputer | str":
        """The model among the live `modules` (live_modules()) whose decoder layers hold these
        attention layers (names in cache order), or why recompute cannot drive it."""
        wanted = [attention_by_name[n] for n in names]
        inner = _inner_model({id(a) for a in wanted}, modules)
        if inner is None:
            return "no decoder stack holding the attention layers was found among the live modules"
        layers = [layer for layer in inner.layers if _attention_of(layer) is not None]
        if [id(_attention_of(layer)) for layer in layers] != [id(a) for a in wanted]:
            return "the decoder layers do not map one to one onto the KV caches (shared or skipped layers)"
        for layer in layers:
            reason = _unsupported(layer, _attention_of(layer))
            if reason:
                return reason
        return cls(inner.embed_input_ids, layers, wanted, list(names))

    @torch.no_grad()
    def run(self, rows: Rows, caches: list[torch.Tensor], layout: PageLayout) -> None:
        """Recompute this step's chosen tokens into `caches` (one per layer)."""
        rule = rows.rec.rule if len(self.layers) > 1 else "first"  # deviation reads layer 1's keys
        every = torch.arange(len(rows.ids), device=rows.ids.device)
        h, residual = self.embed(rows.ids), None  # [N, hidden]
        start = 0
        if rule == "deviation":  # layer 0 for every candidate, then keep the keys that moved most
            h, residual = self._layer(0, rows, _Attend(rows, every, layout, caches[0].shape), h, residual, caches, layout)
            fresh = self._probe(1, rows, h, residual, caches[1], layout)  # [N, H, D]
            injected, _ = layout.gather(caches[1], rows.slots)
            keep = top_per_fact(key_deviation(fresh, injected).cpu(), rows.lengths, rows.rec).to(h.device)
            every, h, residual, start = keep, h[keep], residual[keep], 1
        else:
            spans, at = [], 0
            for n in rows.lengths:
                spans.append((at, n))
                at += n
            keep = positional(spans, Recompute(rows.rec.fraction, rule)).to(h.device)
            every, h = keep, h[keep]
        attend = _Attend(rows, every, layout, caches[0].shape)
        for i in range(start, len(self.layers)):
            h, residual = self._layer(i, rows, attend, h, residual, caches, layout)

    def _layer(self, i: int, rows: Rows, attend: _Attend, h, residual, caches, layout):
        """Layer i over the chosen rows: writes their K/V, returns (hidden, residual) [M, hidden]."""
        with _swapped(self.attention[i], _GatheredAttention(self.attention[i], caches[i], layout, attend)):
            return self.layers[i](attend.positions, h, residual)

    def _probe(self, i: int, rows: Rows, h, residual, cache, layout) -> torch.Tensor:
        """The keys [N, H, D] layer i computes for every row, as it would cache them; nothing written."""
        seen = []

        def probe(query, key, value, *args, **kwargs):
            seen.append(key)
            attn = self.attention[i]
            return query.new_zeros(query.shape[0], attn.num_heads * attn.head_size_v)

        with _swapped(self.attention[i], probe):
            self.layers[i](rows.positions, h, residual)
        return seen[0].view(len(rows.ids), self.attention[i].num_kv_heads, -1)


class _Attend:
    """Who attends to what, for one set of chosen rows: per request, its chosen rows, their
    positions and its context's cache coordinates (the same in every layer: computed once)."""

    def __init__(self, rows: Rows, chosen: torch.Tensor, layout: PageLayout, shape: torch.Size) -> None:
        self.slots = rows.slots[chosen]  # [M]
        self.positions = rows.positions[chosen]  # [M]
        self.parts = []  # per request: (its rows [m] among the chosen, their positions [m], 0..E-1 [E], coords of E)
        positions = self.positions
        starts = torch.tensor([s for s, _ in rows.request[1:]], dtype=torch.long, device=chosen.device)
        owner = torch.bucketize(chosen, starts, right=True)  # [M] request of each chosen row
        for r, context in enumerate(rows.context):
            mine = (owner == r).nonzero().squeeze(1)
            if len(mine):
                keys = torch.arange(len(context), device=chosen.device)
                self.parts.append((mine, positions[mine], keys, layout.coords(context, shape)))


class _GatheredAttention:
    """An attention layer's forward for recomputed rows: write their K/V into their slots, then
    attend each request's rows to its slots 0..E-1, causally (and within a sliding window)."""

    def __init__(self, attn, cache: torch.Tensor, layout: PageLayout, attend: _Attend) -> None:
        self.attn, self.cache, self.layout, self.attend = attn, cache, layout, attend
        w = attn.sliding_window
        self.window = w if isinstance(w, int) and w > 0 else None
        self.cap = getattr(attn.impl, "logits_soft_cap", None) or None

    def __call__(self, query, key, value, *args, **kwargs) -> torch.Tensor:
        a = self.attn
        m = query.shape[0]
        q = query.view(m, a.num_heads, a.head_size)  # [M, Hq, D]
        k, v = key.view(m, a.num_kv_heads, a.head_size), value.view(m, a.num_kv_heads, a.head_size_v)
        a.impl.do_kv_cache_update(a, k, v, self.cache, self.attend.slots)
        out = query.new_empty(m, a.num_heads, a.head_size_v)
        for mine, positions, keys, coords in self.attend.parts:
            seen = keys[None] <= positions[:, None]  # [m, E]
            if self.window is not None:
                seen &= positions[:, None] - keys[None] < self.window
            out[mine] = self._attend(q[mine], seen, *self.layout.read(self.cache, coords)).to(out.dtype)
        return out.view(m, -1)

    def _attend(self, q: torch.Tensor, seen: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [m, Hq, D] over k, v [E, Hkv, D] where seen [m, E] -> [m, Hq, Dv], float32 math."""
        a = self.attn
        q, k, v = (t.float().transpose(0, 1) for t in (q, k, v))  # [H, m|E, D]
        if self.cap is None:  # one fused kernel; grouped-query heads shared without copies
            out = torch.nn.functional.scaled_dot_product_attention(
                q[None], k[None], v[None], attn_mask=seen[None, None], scale=a.impl.scale,
                enable_gqa=a.num_heads != a.num_kv_heads)[0]
        else:  # Gemma 2's soft cap on the scores: no fused kernel has it
            group = a.num_heads // a.num_kv_heads
            k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
            scores = self.cap * torch.tanh(torch.einsum("hmd,hed->hme", q, k) * a.impl.scale / self.cap)
            out = torch.einsum("hme,hed->hmd", scores.masked_fill(~seen[None], float("-inf")).softmax(-1), v)
        return out.transpose(0, 1)


@contextlib.contextmanager
def _swapped(module: torch.nn.Module, forward):
    """The module's forward replaced for the duration (an instance attribute over the class's)."""
    module.forward = forward
    try:
        yield
    finally:
        del module.forward


def _attention_of(layer: torch.nn.Module):
    return getattr(getattr(layer, "self_attn", None), "attn", None)


def live_modules() -> list[torch.nn.Module]:
    """Every live torch module. The static forward context has the attention layers but not the
    modules around them (their decoder layers, rotary embeddings, the model), so the connector
    finds those here, once at start-up, in one walk for all its uses."""
    with warnings.catch_warnings():  # isinstance() on some live objects warns (torch's deprecated reduce_op)
        warnings.simplefilter("ignore")
        return [obj for obj in gc.get_objects() if isinstance(obj, torch.nn.Module)]


def _inner_model(attention_ids: set[int], modules: list[torch.nn.Module]):
    """Among `modules`: the one with `embed_input_ids` and a `layers` list whose layers'
    `self_attn.attn` are the given attention layers (vLLM's Llama, Qwen, Gemma, Mistral, Phi-3...)."""
    for obj in modules:
        layers = getattr(obj, "layers", None)
        if isinstance(layers, torch.nn.ModuleList) and hasattr(obj, "embed_input_ids") \
                and any(id(_attention_of(layer)) in attention_ids for layer in layers):
            return obj
    return None


def _unsupported(layer: torch.nn.Module, attn) -> str | None:
    params = list(inspect.signature(layer.forward).parameters)
    if params[:3] != ["positions", "hidden_states", "residual"]:
        return f"{type(layer).__name__}.forward takes ({', '.join(params)}), not (positions, hidden_states, residual)"
    if any("moe" in type(m).__name__.lower() or "expert" in type(m).__name__.lower() for m in layer.modules()):
        return f"{type(layer).__name__} routes tokens through experts (MoE)"
    if getattr(attn.impl, "alibi_slopes", None) is not None:
        return "ALiBi attention"
    if getattr(attn, "kv_sharing_target_layer_name", None):
        return "a layer that reads another layer's KV cache (cross-layer sharing)"
    return None
