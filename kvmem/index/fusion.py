"""Fusing a dense and a lexical ranking into one (reciprocal-rank fusion).

Ranks, not scores, are fused: cosine similarities and BM25 scores live on scales that differ per
query and per scope, and RRF needs no normalisation or per-corpus weight to stay sensible.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmem.index.base import Hit


def reciprocal_rank(rankings: Sequence[Sequence[Hit]], k: int, c: float = 60.0,
                    weights: Sequence[float] | None = None) -> list[Hit]:
    """Top-k ids by sum over rankings of weight / (c + rank), rank from 1; ties by id.

    The score of a fused hit is that sum (not a cosine)."""
    weights = weights or [1.0] * len(rankings)
    scores: dict[str, float] = {}
    for ranking, weight in zip(rankings, weights):
        for rank, hit in enumerate(ranking, start=1):
            scores[hit.id] = scores.get(hit.id, 0.0) + weight / (c + rank)
    best = sorted(scores.items(), key=lambda p: (-p[1], p[0]))[:k]
    return [Hit(fact_id, score) for fact_id, score in best]
