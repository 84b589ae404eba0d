"""Fusing the dense and the lexical ranking of a query's candidate facts into one.

Linear fusion of min-max normalised scores: on the LoCoMo tuning conversations it beat
reciprocal-rank fusion at every constant tried (recall@10 0.660 against at most 0.651; dense
alone 0.611) and was flat for a dense weight between 0.4 and 0.7 (docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from kvmem.config import RetrievalConfig
from kvmem.index.base import Hit, best_first


def hybrid_search(vectors, lexical, scope_key: str, vector: np.ndarray, query: str, k: int,
                  conditions: Any = None, depth: int = RetrievalConfig.depth,
                  dense_weight: float = RetrievalConfig.dense_weight) -> list[Hit]:
    """Top-k of a scope by fused dense and BM25 scores: the candidates are the top `depth` of
    each ranking; `vectors` (a VectorIndex) gives every candidate's cosine (the dense top's
    from its search, the others' by `similarities`), `lexical` (LexicalIndex) its BM25."""
    depth = max(k, depth)
    top = vectors.ranked(scope_key, vector, depth, conditions)
    dense = dict(zip(top.ids, top.scores.tolist()))
    bm25 = lexical.scores(scope_key, query, conditions, top=depth, also=dense)
    others = [i for i, s in bm25.items() if s > 0 and i not in dense]
    if others:
        dense.update(vectors.similarities(scope_key, vector, others))
    return linear(dense, bm25, k, dense_weight)


def linear(dense: Mapping[str, float], lexical: Mapping[str, float], k: int, dense_weight: float) -> list[Hit]:
    """Top-k of the candidates in `dense` (cosine per id, every candidate) by
    dense_weight * minmax(cosine) + (1 - dense_weight) * BM25 / max BM25, ties by id.

    BM25 is divided by its maximum only: most facts share no term with a query and score 0, so
    0 is the scope's minimum. The best candidate of each ranking always stays in the top k
    (k >= 2): a fact that matches the query's words best is never fused away."""
    if not dense:
        return []
    ids = list(dense)
    cos = np.fromiter(dense.values(), np.float64, len(ids))  # [m]
    bm25 = np.fromiter((lexical.get(i, 0.0) for i in ids), np.float64, len(ids))  # [m]
    low, high = cos.min(), cos.max()
    top_lexical = max(lexical.values(), default=0.0)
    fused = (dense_weight * ((cos - low) / (high - low) if high > low else np.ones_like(cos))
             + (1 - dense_weight) * (bm25 / top_lexical if top_lexical > 0 else 0.0))  # [m]
    ranked = best_first(fused, ids.__getitem__).tolist()  # best first, ties by id
    pinned = [_best(cos, ids)]
    if (bm25 > 0).any():
        pinned.append(_best(bm25, ids))
    pinned = sorted(set(pinned), key=ranked.index)[:k]  # ranked.index: 2 lookups, no map of all m
    others = [i for i in ranked[: k + len(pinned)] if i not in pinned][: k - len(pinned)]
    chosen, hits = set(pinned) | set(others), []
    for i in ranked:  # a pinned candidate may sit far down the fused ranking
        if i in chosen:
            hits.append(Hit(ids[i], float(fused[i])))
            if len(hits) == len(chosen):
                break
    return hits


def _best(values: np.ndarray, ids: list[str]) -> int:
    """Position of the highest of `values` [m], the smallest id among equals."""
    return min(np.flatnonzero(values == values.max()).tolist(), key=ids.__getitem__)
