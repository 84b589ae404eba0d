"""Selective recompute inside the worker: chosen fact tokens computed again over the injected cache.

Runs in vLLM's worker process, in `start_load_kv`, after a step's blobs are written into the
paged cache and before the engine's forward pass (outside CUDA graphs). For the tokens that
kv/recompute.py chooses, it runs the model's own decoder layers, one after another: their hidden
states start from the embedding; at each layer their new K/V are written into their paged slots,
then their queries attend, causally, to every slot of their request up to themselves.
Only the chosen tokens are carried from layer to layer (CacheBlend's scheme; rule "progressive"
narrows them at every layer), so the cost is their share of a prefill; tokens the engine then
computes read the corrected cache.

The layers run unchanged: for the duration, each attention layer's `forward` is swapped for one
that does the write and the attention itself, with metadata of its own: on vLLM's CPU backend
through the engine's own paged attention kernel, so a full recompute is text prefill's arithmetic;
elsewhere gathered, in float32 (kvmem/connector/recompute_attention.py). Model structures this cannot drive are refused once, at
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

from kvmem.connector.paged import PageLayout
from kvmem.connector.recompute_attention import (Chosen, EngineKernel, GatheredAttention, engine_kernel_serves,
                                                 group_window)
from kvmem.kv.recompute import (SCORED, Recompute, key_deviation, positional, progressive_count, top_counts,
                                top_per_fact, top_per_request)

log = logging.getLogger("kvmem.connector")


@dataclass(frozen=True)
class Rows:
    """One step's recompute: the requests' candidate fact tokens, request after request."""

    ids: torch.Tensor  # [N] token ids, on the device
    positions: torch.Tensor  # [N] prompt positions, on the device
    slots: torch.Tensor  # [N] their paged slots, on the device
    request: list[tuple[int, int]]  # per request: (its first row, its row count), in row order
    blocks: list[tuple[int, ...]]  # per request: its block ids in prompt order
    ends: list[int]  # per request: its injected end E (positions 0..E-1 are in its pages)
    lengths: list[int]  # per fact (span), its candidate count, in row order
    rec: Recompute  # the requests' common setting
    block_size: int

    @classmethod
    def of_jobs(cls, members: list, rec: Recompute, token_ids: torch.Tensor, positions: torch.Tensor,
                slots: torch.Tensor, block_size: int, device: torch.device) -> "Rows | None":
        """The fact tokens of these load jobs as rows. members: (job, index of its first token
        in the step's staging order); token_ids, positions, slots: [N] host tensors in that
        order. The head (the segment at prompt position 0) is never recomputed."""
        index, request, blocks, ends, lengths, first = [], [], [], [], [], 0
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
                blocks.append(tuple(job.block_ids))
                ends.append(max(s.end for s in job.spans))
        if not index:
            return None
        index = torch.cat(index)
        return cls(ids=token_ids[index].to(device), positions=positions[index].to(device),
                   slots=slots[index].to(device), request=request, blocks=blocks, ends=ends, lengths=lengths,
                   rec=rec, block_size=block_size)

    def chosen(self, rows: torch.Tensor) -> Chosen:
        """These rows [M] (sorted indices into the step's rows) as the attention sees them."""
        starts = torch.tensor([s for s, _ in self.request[1:]], dtype=torch.long, device=rows.device)
        owner = torch.bucketize(rows, starts, right=True)  # [M] request of each chosen row
        return Chosen(self.slots[rows], self.positions[rows], owner, self.blocks, self.ends, self.block_size)


class Recomputer:
    """The model's embedding and decoder layers, as the recompute drives them."""

    def __init__(self, embed, layers: list[torch.nn.Module], attention: list[torch.nn.Module],
                 names: list[str]) -> None:
        self.embed = embed  # token ids [N] -> hidden [N, hidden]
        self.layers = layers  # decoder layers in cache order: (positions, hidden, residual) -> (hidden, residual)
        self.attention = attention  # each layer's attention module (static forward context)
        self.names = names  # their names, in that order
        # vLLM's CPU kernel where every layer has it (text prefill's own arithmetic), else gathered.
        self.engine_kernel = engine_kernel_serves(attention)
        self.group_window = group_window(attention) if self.engine_kernel else -1

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
        rule = rows.rec.rule if len(self.layers) > 1 else "first"  # the scored rules read layer 1's keys
        every = torch.arange(len(rows.ids), device=rows.ids.device)
        h, residual = self.embed(rows.ids), None  # [N, hidden]
        start = 0
        if rule in SCORED:  # layer 0 for every candidate, then keep the keys that moved most
            h, residual = self._layer(0, self._attention(rows.chosen(every), layout, caches[0].shape),
                                      h, residual, caches)
            fresh = self._probe(1, rows, h, residual)  # [N, H, D]
            injected, _ = layout.gather(caches[1], rows.slots)
            keep = _scored(rule, key_deviation(fresh, injected).cpu(), rows, len(self.layers)).to(h.device)
            h, residual, start = h[keep], residual[keep], 1
            if rule == "progressive":
                return self._progressive(rows, keep, h, residual, caches, layout)
        else:
            spans, at = [], 0
            for n in rows.lengths:
                spans.append((at, n))
                at += n
            keep = positional(spans, Recompute(rows.rec.fraction, rule)).to(h.device)
            h = h[keep]
        attention = self._attention(rows.chosen(keep), layout, caches[0].shape)
        for i in range(start, len(self.layers)):
            h, residual = self._layer(i, attention, h, residual, caches)

    def _progressive(self, rows: Rows, keep, h, residual, caches, layout: PageLayout) -> None:
        """Rule "progressive" from layer 1 on: after each layer, of the rows it computed, each
        fact keeps the `progressive_count` whose keys that layer moved most from the injected."""
        fact = torch.repeat_interleave(torch.arange(len(rows.lengths)), torch.tensor(rows.lengths))  # [N] (host)
        layers = len(self.layers)
        for i in range(1, layers):
            attention = self._attention(rows.chosen(keep), layout, caches[0].shape)
            moved: list[torch.Tensor] = []
            measured = _measuring(attention.forward(self.attention[i], caches[i]), layout, caches[i],
                                  rows.slots[keep], self.attention[i].num_kv_heads, moved)
            with _swapped(self.attention[i], measured):
                h, residual = self.layers[i](attention.positions, h, residual)
            if i + 1 < layers:
                held = torch.bincount(fact[keep.cpu()], minlength=len(rows.lengths)).tolist()  # rows per fact
                counts = [min(c, progressive_count(n, rows.rec, i + 1, layers)) for c, n in zip(held, rows.lengths)]
                pick = top_counts(moved[0].cpu(), held, counts).to(h.device)
                keep, h, residual = keep[pick], h[pick], residual[pick]

    def _attention(self, chosen: Chosen, layout: PageLayout, shape: torch.Size):
        if self.engine_kernel and all(hasattr(a, "isa") for a in self.attention):  # isa: set by the engine's metadata builder
            return EngineKernel(chosen, self.group_window)
        return GatheredAttention(chosen, layout, shape)

    def _layer(self, i: int, attention, h, residual, caches):
        """Layer i over the chosen rows: writes their K/V, returns (hidden, residual) [M, hidden]."""
        with _swapped(self.attention[i], attention.forward(self.attention[i], caches[i])):
            return self.layers[i](attention.positions, h, residual)

    def _probe(self, i: int, rows: Rows, h, residual) -> torch.Tensor:
        """The keys [N, H, D] layer i computes for every row, as it would cache them; nothing written."""
        seen = []

        def probe(query, key, value, *args, **kwargs):
            seen.append(key)
            attn = self.attention[i]
            return query.new_zeros(query.shape[0], attn.num_heads * attn.head_size_v)

        with _swapped(self.attention[i], probe):
            self.layers[i](rows.positions, h, residual)
        return seen[0].view(len(rows.ids), self.attention[i].num_kv_heads, -1)


def _scored(rule: str, deviation: torch.Tensor, rows: Rows, layers: int) -> torch.Tensor:
    """deviation [N] (host) of every candidate's layer-1 keys -> the rows [M] computed from layer 1."""
    if rule == "global":
        return top_per_request(deviation, [n for _, n in rows.request], rows.rec)
    if rule == "progressive":
        return top_counts(deviation, rows.lengths, [progressive_count(n, rows.rec, 1, layers) for n in rows.lengths])
    return top_per_fact(deviation, rows.lengths, rows.rec)


def _measuring(forward, layout: PageLayout, cache: torch.Tensor, slots: torch.Tensor, heads: int,
               out: list[torch.Tensor]):
    """A layer's recompute `forward` that first records, per row, how far its fresh keys lie from
    the injected ones it is about to overwrite (key_deviation, [M])."""
    def measured(query, key, value, *args, **kwargs):
        injected, _ = layout.gather(cache, slots)  # [M, H, D], before this layer's write
        out.append(key_deviation(key.view(len(slots), heads, -1), injected))
        return forward(query, key, value, *args, **kwargs)

    return measured


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
