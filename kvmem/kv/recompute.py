"""Selective recompute: which injected fact tokens are computed again with the other facts in view.

Facts are encoded one at a time, so no fact's KV ever attended to the facts served before it.
Recomputing a few tokens of each fact layer by layer, over the whole injected cache (as
CacheBlend does), supplies that cross-fact attention at a fraction of text prefill's cost. This
module is the selection half, shared by the lab (tune/blend.py, transformers) and the connector
(connector/recompute.py, inside vLLM): plain torch, no model.

Every rule but "global" selects per fact: each fact recomputes `count(length)` of its own tokens.
A token's recomputed KV then depends only on the tokens before it (and on the settings), which
vLLM's block hashes (chained over the prompt) and the chat's cache salt (which names the
settings) already cover, so a cached block holding recomputed KV can only serve a request that
would have computed the same KV.

Rules:
- "deviation" (CacheBlend): every fact token's layer 0 is recomputed; the tokens whose fresh
  layer-1 keys differ most from the injected ones go on through the remaining layers.
- "progressive" (CacheBlend's gradual filtering): as deviation, but the set is chosen again at
  every layer from the tokens still computed, by how far that layer's fresh keys moved: 1.5x the
  fraction's count at layer 1, falling linearly to 0.5x at the last layer, so the layers' mean
  is the fraction's budget (`progressive_count`).
- "global": as deviation, with one budget over all of a request's fact tokens (a fact that
  moved more takes more of it). An early fact's recomputed KV then depends on the facts after
  it, so a cached block of it may serve a later request whose later facts differ: the KV it
  finds is a recompute, but of another selection than its own would have been.
- "first" (EPIC): the first tokens of each fact.
- "last": the last tokens of each fact, the links a reader crosses from one fact to the next.
- "oracle": the tokens whose injected KV is farthest from true text prefill's (lab only: needs
  text prefill's KV, the very cost recompute avoids).

For every rule the plan reports `count(length)` per fact as the recomputed tokens: the budget,
which "global" spreads across facts and "progressive" across layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:  # the settings travel in plans that torch-free commands build: torch only where used
    import torch

RULES = ("deviation", "progressive", "global", "first", "last", "oracle")
ENGINE_RULES = ("deviation", "progressive", "global", "first", "last")  # oracle needs text prefill's KV
SCORED = ("deviation", "progressive", "global")  # rules that read layer 1's key deviation


@dataclass(frozen=True)
class Recompute:
    fraction: float = 0.0  # of each fact's tokens; 0: plain injection, 1: every fact token (= text prefill)
    rule: str = "deviation"

    def __post_init__(self) -> None:
        if isinstance(self.fraction, bool) or not isinstance(self.fraction, (int, float)) \
                or not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"recompute fraction must be a number in [0, 1], got {self.fraction!r}")
        if self.rule not in RULES:
            raise ValueError(f"recompute rule must be one of {RULES}, got {self.rule!r}")

    @property
    def on(self) -> bool:
        return self.fraction > 0

    def count(self, length: int) -> int:
        """Tokens recomputed of a fact of `length` tokens: at least one whenever recompute is on."""
        return 0 if not self.on else min(length, max(1, math.ceil(self.fraction * length - 1e-9)))

    @property
    def tag(self) -> str:
        """A stable name for cache salts and result files."""
        return "off" if not self.on else f"{self.rule}-{self.fraction:g}"

    def to_params(self) -> dict[str, Any]:
        return {"fraction": float(self.fraction), "rule": self.rule}

    @classmethod
    def from_params(cls, body: Any) -> "Recompute":
        """ValueError on a malformed body (the connector then ignores the plan, as for any)."""
        if not isinstance(body, dict):
            raise ValueError(f"recompute must be an object, got {body!r}")
        return cls(body.get("fraction", 0.0), body.get("rule", "deviation"))


def positional(spans: Sequence[tuple[int, int]], rec: Recompute) -> "torch.Tensor":
    """Rules "first" / "last": spans (start, length) of the facts -> chosen positions [N], sorted."""
    import torch

    if rec.rule not in ("first", "last"):
        raise ValueError(f"rule {rec.rule!r} does not choose by position")
    chosen = []
    for start, length in spans:
        n = rec.count(length)
        first = start if rec.rule == "first" else start + length - n
        chosen.append(torch.arange(first, first + n))
    return torch.cat(chosen) if chosen else torch.zeros(0, dtype=torch.long)


def top_per_fact(scores: "torch.Tensor", lengths: Sequence[int], rec: Recompute) -> "torch.Tensor":
    """scores [N] over the facts' tokens, fact after fact (lengths sum to N) -> indices into
    them [M] of each fact's `count` highest-scoring tokens, sorted."""
    return top_counts(scores, lengths, [rec.count(n) for n in lengths])


def top_per_request(scores: "torch.Tensor", requests: Sequence[int], rec: Recompute) -> "torch.Tensor":
    """Rule "global": scores [N] over requests' fact tokens, request after request (`requests`:
    each one's token count) -> indices [M] of each request's `count(its tokens)` highest, sorted."""
    return top_counts(scores, requests, [rec.count(n) for n in requests])


def progressive_count(length: int, rec: Recompute, layer: int, layers: int) -> int:
    """Rule "progressive": tokens of a fact of `length` still computed at `layer` (1..layers-1):
    1.5x the fraction's share at layer 1, 0.5x at the last layer, linear between (mean: the
    fraction), at least one and at most `length`."""
    scale = 1.0 if layers <= 2 else 1.5 - (layer - 1) / (layers - 2)
    return min(length, max(1, math.ceil(rec.fraction * scale * length - 1e-9)))


def top_counts(scores: "torch.Tensor", lengths: Sequence[int], counts: Sequence[int]) -> "torch.Tensor":
    """scores [N] over groups of `lengths` tokens, one group after another -> indices into them
    [M] of each group's `counts` highest-scoring tokens, sorted."""
    import torch

    if sum(lengths) != scores.shape[0]:
        raise ValueError(f"{scores.shape[0]} scores for groups of {sum(lengths)} tokens")
    chosen, at = [], 0
    for length, n in zip(lengths, counts):
        if n:
            chosen.append(at + scores[at : at + length].topk(min(n, length)).indices)
        at += length
    return torch.cat(chosen).sort().values if chosen else torch.zeros(0, dtype=torch.long)


def key_deviation(fresh: "torch.Tensor", injected: "torch.Tensor") -> "torch.Tensor":
    """Per token, how far the injected keys are from freshly computed ones: [N, ...] each -> [N]
    (L2 over every head and dim, in float32)."""
    return (fresh.float() - injected.float()).flatten(1).norm(dim=1)
