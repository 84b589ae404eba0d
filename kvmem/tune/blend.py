"""Selective recompute in the lab (transformers, fp32): the connector's recompute, rebuilt on a
Hugging Face model so rules and budgets can be compared without vLLM.

`blend` takes KV mode's memory cache (lab.memory_cache, maybe through the reader's KV map) and
recomputes the chosen fact tokens layer by layer: their hidden states start from the embedding,
and at each layer their new K/V replace the injected ones before their queries attend, causally,
to the whole memory. Only the chosen tokens are carried from layer to layer; every other token
keeps its injected KV (CacheBlend's scheme). Recomputing every fact token is text prefill.

The model's own decoder layers run unchanged: a cache object scatters the chosen tokens' K/V
into the memory and hands attention the whole of it, and a mask says which memory positions each
chosen token may see (causal, and the sliding window of layers that have one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmem.kv.recompute import Recompute, key_deviation, positional, top_per_fact
from kvmem.tune.lab import Example, layer_types, rope_tables


@dataclass
class Blended:
    layers: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k, v) [1, kv_heads, M, d]
    recomputed: int  # fact tokens carried through every layer
    layer0: int  # fact tokens recomputed at layer 0 only ("deviation" looks at them all)


class _Scatter:
    """The `past_key_values` a decoder layer sees: new K/V [1, H, S, d] written at `positions`
    of the memory (unless probing), and the whole memory [1, H, M, d] handed to attention."""

    def __init__(self, layers, positions: torch.Tensor) -> None:
        self.layers = layers
        self.positions = positions
        self.probe: list[torch.Tensor] | None = None  # when set: record the keys, write nothing

    def update(self, keys, values, layer_idx, *args, **kwargs):
        k, v = self.layers[layer_idx]
        if self.probe is not None:
            self.probe.append(keys)
            return k, v
        k, v = k.clone(), v.clone()
        k[:, :, self.positions], v[:, :, self.positions] = keys, values
        self.layers[layer_idx] = (k, v)
        return k, v


def _mask(positions: torch.Tensor, m: int, window: int | None) -> torch.Tensor:
    """[1, 1, S, M] additive: 0 where a chosen token at `positions` may attend a memory position."""
    keys = torch.arange(m)[None]
    seen = keys <= positions[:, None]
    if window is not None:
        seen &= positions[:, None] - keys < window
    return torch.where(seen, 0.0, float("-inf"))[None, None]


class _Model:
    """The pieces of a Hugging Face decoder the recompute needs, found once per model."""

    def __init__(self, model) -> None:
        self.model, self.inner = model, model.model
        self.types = layer_types(model)
        self.window = getattr(model.config, "sliding_window", None)

    def position_embeddings(self, h, positions, i: int):
        return rope_tables(self.model, h, positions[None], i)

    def layer(self, i: int, h, positions, cache: _Scatter) -> torch.Tensor:
        window = self.window if self.types[i] == "sliding_attention" else None
        m = cache.layers[i][0].shape[2]
        out = self.inner.layers[i](h, attention_mask=_mask(positions, m, window), position_ids=positions[None],
                                   past_key_values=cache, position_embeddings=self.position_embeddings(h, positions, i))
        return out[0] if isinstance(out, tuple) else out


def fact_spans(ex: Example) -> list[tuple[int, int]]:
    """(start, length) of each fact in the memory."""
    spans, at = [], len(ex.head)
    for _, fact in ex.facts:
        spans.append((at, len(fact)))
        at += len(fact)
    return spans


@torch.no_grad()
def blend(model, ex: Example, layers, rec: Recompute, text_layers=None) -> Blended:
    """KV mode's memory `layers` (per layer (k, v) [1, kv_heads, M, d]) with the tokens `rec`
    chooses recomputed. `text_layers` (text prefill's memory cache) only for rule "oracle"."""
    layers = list(layers)
    spans = fact_spans(ex)
    if not rec.on or not spans:
        return Blended(layers, 0, 0)
    m = _Model(model)
    ids = torch.tensor(ex.memory_ids)
    every = torch.cat([torch.arange(s, s + n) for s, n in spans])  # [F] all fact tokens
    if rec.rule in ("progressive", "global"):
        raise ValueError(f"the lab does not implement rule {rec.rule!r}: measure it on the engine (kvmem eval locomo)")
    if rec.rule in ("first", "last"):
        chosen = positional(spans, rec)
    elif rec.rule == "oracle":
        if text_layers is None:
            raise ValueError("rule 'oracle' needs text prefill's cache (text_layers)")
        chosen = every[top_per_fact(_distance(layers, text_layers, every), [n for _, n in spans], rec)]
    else:
        return _blend_by_deviation(m, ids, layers, spans, every, rec)
    h = m.inner.embed_tokens(ids[chosen][None])
    cache = _Scatter(layers, chosen)
    for i in range(len(layers)):
        h = m.layer(i, h, chosen, cache)
    return Blended(cache.layers, len(chosen), len(chosen))


def _blend_by_deviation(m: _Model, ids, layers, spans, every, rec: Recompute) -> Blended:
    """CacheBlend: layer 0 for every fact token, then the tokens whose layer-1 keys moved most."""
    cache = _Scatter(layers, every)
    h = m.layer(0, m.inner.embed_tokens(ids[every][None]), every, cache)  # [1, F, hidden]
    cache.probe = []
    m.layer(1, h, every, cache)
    fresh = cache.probe[0][0].transpose(0, 1)  # [F, H, d]
    injected = cache.layers[1][0][0][:, every].transpose(0, 1)
    pick = top_per_fact(key_deviation(fresh, injected), [n for _, n in spans], rec)
    chosen, h = every[pick], h[:, pick]
    cache.probe, cache.positions = None, chosen
    for i in range(1, len(layers)):
        h = m.layer(i, h, chosen, cache)
    return Blended(cache.layers, len(chosen), len(every))


def _distance(layers, text_layers, positions: torch.Tensor) -> torch.Tensor:
    """[F] per fact token, the L2 distance of its injected K and V from text prefill's, summed
    over layers, each layer's scaled by its text KV's typical norm so no layer dominates."""
    total = torch.zeros(len(positions))
    for (k, v), (tk, tv) in zip(layers, text_layers):
        for a, b in ((k, tk), (v, tv)):
            a, b = a[0][:, positions].transpose(0, 1), b[0][:, positions].transpose(0, 1)  # [F, H, d]
            total += key_deviation(a, b) / b.flatten(1).norm(dim=1).mean().clamp_min(1e-6)
    return total


def text_cache(model, ex: Example) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Text prefill's cache of the memory: per layer (k, v) [1, kv_heads, M, d]."""
    ids = torch.tensor([ex.memory_ids])
    with torch.no_grad():
        cache = model.model(input_ids=ids, use_cache=True).past_key_values
    return [(cache.layers[i].keys, cache.layers[i].values) for i in range(model.config.num_hidden_layers)]


def flops_fraction(ex: Example, blended: Blended, n_layers: int) -> float:
    """Recompute's token-layers over text prefill's (the prompt's every token through every
    layer); attention's share is left out (it grows with length, and the chosen few are short)."""
    # "deviation" also runs layers 0 and 1 over every fact token, to find the ones to carry on.
    spent = blended.recomputed * n_layers + (blended.layer0 - blended.recomputed) * 2
    return spent / (len(ex.ids) * n_layers)
