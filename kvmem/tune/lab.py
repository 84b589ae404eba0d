"""KV mode rebuilt in PyTorch (transformers), to measure and train the reader without vLLM.

kvmem serves a chat as [head][fact_1..fact_k][tail]: the head's KV and each fact's KV come from
blobs, each fact encoded on its own as [head][context][fact] and its keys moved by RoPE to the
position the fact takes in the chat; only the tail is computed. `memory_cache` builds that same
cache from a Hugging Face model, and `Layout` names the variants the diagnosis compares
(where each fact is encoded, and after what).

Keys in a transformers cache are stored rotated, as in vLLM's, so moving a fact from encoding
position p to serving position q is one more rotation by q - p.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch

from kvmem.errors import UnsupportedConfigError
from kvmem.reader.kvmap import rotate_half


@dataclass(frozen=True)
class Example:
    """One chat as kvmem serves it: token ids per piece, in prompt order."""

    head: tuple[int, ...]
    facts: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]  # (context tokens, fact tokens)
    tail: tuple[int, ...]

    @property
    def memory_ids(self) -> tuple[int, ...]:
        return self.head + tuple(t for _, fact in self.facts for t in fact)

    @property
    def ids(self) -> tuple[int, ...]:
        return self.memory_ids + self.tail


@dataclass(frozen=True)
class Layout:
    """How each fact's KV is computed before it is placed after the others.

    prefix: "head" (what kvmem does: the chat's head, then the fact's context window) or
    "sink" (only the head's first token, a neutral separator that still gives attention a sink).
    moved: True = encoded right after its prefix, keys moved to the serving position (kvmem);
    False = encoded at its true serving position (a gap in positions after the prefix).
    """

    prefix: str = "head"
    moved: bool = True


KVMEM = Layout()


def rotary(model):
    rope = getattr(getattr(model, "model", None), "rotary_emb", None)
    if rope is None:
        raise UnsupportedConfigError(f"{type(model).__name__} has no single rotary embedding (model.model.rotary_emb)")
    return rope


# Hugging Face model types whose RoPE rotates neighbouring dims (2i, 2i + 1) together, where the
# lab's re-rotation and the KV map pair dim i with i + D/2 (neox, rotate_half).
_INTERLEAVED = frozenset({"cohere", "cohere2", "glm", "glm4", "chatglm", "gptj", "codegen"})


def layer_types(model) -> list[str]:
    """Each layer's attention type (Gemma 3: "sliding_attention" or "full_attention"), which
    picks its rotary base where the model has one per type."""
    cfg = model.config
    return list(getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers)


def rope_tables(model, x: torch.Tensor, positions: torch.Tensor, layer: int):
    """(cos, sin) [b, n, R] of layer `layer` at `positions` [b, n]: the model's own rotary
    embedding, asked with the layer's type where it rotates layers differently (Gemma 3)."""
    rope = rotary(model)
    if _takes_layer_type(type(rope)):
        return rope(x, positions, layer_types(model)[layer])
    return rope(x, positions)


@functools.cache
def _takes_layer_type(rope_class) -> bool:
    """Whether forward is (x, position_ids, layer_type): asked once per class, not per call."""
    return len(inspect.signature(rope_class.forward).parameters) > 3  # self, x, position_ids[, layer_type]


def rotary_dim(model) -> int:
    """R: how many of a head's dims RoPE rotates (the head's all, unless rotary is partial)."""
    cfg = model.config
    head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    cos, _ = rope_tables(model, torch.zeros(1, 1, head), torch.zeros(1, 1, dtype=torch.long), 0)  # [1, 1, R]
    return cos.shape[-1]


def check_rotary(model) -> int:
    """Refuse a model the lab cannot move keys for: its rotary must be neox-style, as kvmem's KV
    map also needs at serving (connector/worker_side.py), with an even head and rotated part;
    per-layer bases (Gemma 3) and partial rotary (Phi-3 with partial_rotary_factor) are fine.
    -> R. Called before any training, so a mismatch costs seconds, not a training run."""
    from kvmem.errors import AdapterError
    from kvmem.reader.kvmap import check_rotary_dim

    cfg = model.config
    if cfg.model_type in _INTERLEAVED:
        raise UnsupportedConfigError(f"{cfg.model_type}: interleaved rotary embeddings; the reader's "
                                     "training and KV map need neox-style (rotate-half) rotation")
    head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    r = rotary_dim(model)
    try:
        check_rotary_dim(head, r)
    except AdapterError as e:
        raise UnsupportedConfigError(f"{cfg.model_type}: {e}") from None
    return r


def move_keys(model, keys: torch.Tensor, delta: torch.Tensor, layer: int = 0) -> torch.Tensor:
    """Layer `layer`'s keys [b, heads, n, d] rotated at p -> rotated at p + delta; delta [b, n]
    ints. Partial rotary: the first R dims turn, the rest stay."""
    cos, sin = rope_tables(model, keys, delta, layer)  # [b, n, R] each
    cos, sin = cos[:, None].to(keys.dtype), sin[:, None].to(keys.dtype)
    r = cos.shape[-1]
    turned = keys[..., :r] * cos + rotate_half(keys[..., :r]) * sin
    return torch.cat((turned, keys[..., r:]), dim=-1)


def _kv_of(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    entry = cache.layers[layer]
    return entry.keys, entry.values


@torch.no_grad()
def _forward_cache(model, ids: torch.Tensor, positions: torch.Tensor):
    from transformers import DynamicCache

    # A cache of whole layers: a sliding-window layer's own cache (Gemma 3) keeps only its last
    # window of tokens, and a fact's every token is moved and served.
    out = model.model(input_ids=ids, position_ids=positions, past_key_values=DynamicCache(), use_cache=True)
    return out.past_key_values


def memory_cache(model, ex: Example, layout: Layout = KVMEM, facts: "FactKV | None" = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (keys, values) [1, kv_heads, len(memory_ids), d] for [head][facts], built as `layout` says.

    `facts` remembers each fact's encoded KV (moved layouts only: there it does not depend on
    where the fact is served), so a fact shared by many examples is encoded once."""
    n_layers = model.config.num_hidden_layers
    head = torch.tensor([ex.head])
    head_cache = _forward_cache(model, head, torch.arange(len(ex.head))[None])
    keys = [[_kv_of(head_cache, i)[0]] for i in range(n_layers)]
    values = [[_kv_of(head_cache, i)[1]] for i in range(n_layers)]
    if facts is not None and facts.layout != layout:
        raise ValueError(f"facts were remembered for {facts.layout}, not {layout}")
    encoded = (facts.get(model, ex) if facts is not None else encode_facts(model, ex, layout)) if ex.facts else []
    at = len(ex.head)
    for enc, (_, fact) in zip(encoded, ex.facts):
        for i, (k, v) in enumerate(enc.layers):  # k, v: [1, kv_heads, len(fact), d] at its encoding positions
            keys[i].append(move_keys(model, k, torch.full((1, len(fact)), at - enc.start), i) if layout.moved else k)
            values[i].append(v)
        at += len(fact)
    return [(torch.cat(k, dim=2), torch.cat(v, dim=2)) for k, v in zip(keys, values)]


@dataclass(frozen=True)
class EncodedFact:
    layers: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k, v) [1, kv_heads, len(fact), d]
    start: int  # the position its first token was encoded at


def encode_facts(model, ex: Example, layout: Layout) -> list[EncodedFact]:
    """Each fact's KV as its layout computes it: all facts in one padded batch."""
    rows, spans = _fact_rows(ex, layout)
    width = max(len(r) for r, _ in rows)
    ids = torch.tensor([r + (0,) * (width - len(r)) for r, _ in rows])  # padded on the right: causal, so harmless
    pos = torch.tensor([p + tuple(range(p[-1] + 1, p[-1] + 1 + width - len(p))) for _, p in rows])
    cache = _forward_cache(model, ids, pos)
    out = []
    for f, (start, length) in enumerate(spans):
        layers = [tuple(t[f : f + 1, :, start : start + length].clone() for t in _kv_of(cache, i))
                  for i in range(model.config.num_hidden_layers)]
        out.append(EncodedFact(layers, int(pos[f, start])))
    return out


class FactKV:
    """Encoded facts remembered by (head, context, fact) tokens, for layouts that move keys afterwards."""

    def __init__(self, layout: Layout = KVMEM) -> None:
        if not layout.moved:
            raise ValueError("only facts whose keys are moved afterwards can be remembered")
        self.layout = layout
        self._kv: dict[tuple, EncodedFact] = {}

    def get(self, model, ex: Example) -> list[EncodedFact]:
        keys = [(ex.head, ctx, fact) for ctx, fact in ex.facts]
        missing = [i for i, key in enumerate(keys) if key not in self._kv]
        if missing:
            sub = Example(ex.head, tuple(ex.facts[i] for i in missing), ())
            for i, enc in zip(missing, encode_facts(model, sub, self.layout)):
                self._kv[keys[i]] = enc
        return [self._kv[key] for key in keys]


def _fact_rows(ex: Example, layout: Layout):
    """Per fact: (encoding ids, their positions), and (its start, length) in the row."""
    rows, spans = [], []
    at = len(ex.head)
    for context, fact in ex.facts:
        prefix = (ex.head + context) if layout.prefix == "head" else ex.head[:1]
        if layout.moved:
            positions = tuple(range(len(prefix) + len(fact)))
        elif len(prefix) > at:
            raise ValueError("a fact's prefix is longer than the memory before it: it cannot sit at its true position")
        else:
            positions = tuple(range(len(prefix))) + tuple(range(at, at + len(fact)))
        rows.append((prefix + fact, positions))
        spans.append((len(prefix), len(fact)))
        at += len(fact)
    return rows, spans


def as_cache(model, layers: list[tuple[torch.Tensor, torch.Tensor]]):
    from transformers import DynamicCache

    # Whole layers (no config): the attention mask, not the cache, keeps a sliding layer in its window.
    return DynamicCache(ddp_cache_data=[(k.clone(), v.clone()) for k, v in layers])


def reply_logits(model, ex: Example, reply: tuple[int, ...], layers=None) -> torch.Tensor:
    """Logits [len(reply), vocab] predicting each reply token: after the memory `layers` built
    (KV mode), or after text prefill of the whole prompt when layers is None."""
    if layers is None:
        ids = torch.tensor([ex.ids + reply[:-1]])
        logits = model(input_ids=ids).logits[0]
        return logits[len(ex.ids) - 1 :]
    m = len(ex.memory_ids)
    ids = torch.tensor([ex.tail + reply[:-1]])
    positions = torch.arange(m, m + ids.shape[1])[None]
    logits = model(input_ids=ids, position_ids=positions, past_key_values=as_cache(model, layers), use_cache=True).logits[0]
    return logits[len(ex.tail) - 1 :]


@torch.no_grad()
def teacher_reply(model, ex: Example, max_tokens: int, eos: set[int]) -> tuple[tuple[int, ...], torch.Tensor]:
    """Text prefill's greedy reply and its logits [len(reply), vocab], each predicting its token
    (from generation itself: one prefill, no second pass over the prompt)."""
    out = model.generate(torch.tensor([ex.ids]), attention_mask=torch.ones(1, len(ex.ids), dtype=torch.long),
                         max_new_tokens=max_tokens, do_sample=False, eos_token_id=sorted(eos) or None,
                         pad_token_id=min(eos, default=0), output_logits=True, return_dict_in_generate=True)
    reply = tuple(out.sequences[0, len(ex.ids):].tolist())
    return reply, torch.cat(out.logits, dim=0)[: len(reply)]
