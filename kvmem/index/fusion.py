"""Fusing the dense and the lexical ranking of a query's candidate facts into one.

Linear fusion of min-max normalised scores: on the LoCoMo tuning conversations it beat
reciprocal-rank fusion at every constant tried (recall@10 0.660 against at most 0.651; dense
alone 0.611) and was flat for a dense weight between 0.4 and 0.7 (docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from kvmem.index.base import Hit


def hybrid_search(vectors, lexical, scope_key: str, vector: np.ndarray, query: str, k: int,
                  conditions: Any = None, depth: int = 100, dense_weight: float = 0.6) -> list[Hit]:
    """Top-k of a scope by fused dense and BM25 scores: the candidates are the top `depth` of
    each ranking; `vectors` (ExactIndex) gives every candidate's cosine, `lexical`
    (LexicalIndex) its BM25."""
    depth = max(k, depth)
    dense_top = [h.id for h in vectors.search(scope_key, vector, depth, conditions)]
    bm25 = lexical.scores(scope_key, query, conditions, top=depth, also=dense_top)
    candidates = dense_top + [i for i in bm25 if bm25[i] > 0]
    return linear(vectors.similarities(scope_key, vector, candidates), bm25, k, dense_weight)


def linear(dense: Mapping[str, float], lexical: Mapping[str, float], k: int, dense_weight: float) -> list[Hit]:
    """Top-k of the candidates in `dense` (cosine per id, every candidate) by
    dense_weight * minmax(cosine) + (1 - dense_weight) * BM25 / max BM25, ties by id.

    BM25 is divided by its maximum only: most facts share no term with a query and score 0, so
    0 is the scope's minimum. The best candidate of each ranking always stays in the top k
    (k >= 2): a fact that matches the query's words best is never fused away."""
    if not dense:
        return []
    low, high = min(dense.values()), max(dense.values())
    top_lexical = max(lexical.values(), default=0.0)
    fused = {i: dense_weight * ((s - low) / (high - low) if high > low else 1.0)
             + (1 - dense_weight) * (lexical.get(i, 0.0) / top_lexical if top_lexical > 0 else 0.0)
             for i, s in dense.items()}
    ranked = sorted(fused, key=lambda i: (-fused[i], i))
    pinned = {_best(dense), _best({i: v for i, v in lexical.items() if v > 0 and i in dense})} - {None}
    pinned = set(sorted(pinned, key=lambda i: (-fused[i], i))[:k])
    rest = [i for i in ranked if i not in pinned][: k - len(pinned)]
    return [Hit(i, fused[i]) for i in sorted(pinned | set(rest), key=lambda i: (-fused[i], i))]


def _best(scores: Mapping[str, float]) -> str | None:
    return min(scores, key=lambda i: (-scores[i], i)) if scores else None
