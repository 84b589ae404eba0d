"""A fact's search vector: its own text, pulled toward the context it was said in.

A turn embedded with the turns before it is found by what they name ("She walks him on the beach"
after "My sister adopted a puppy called Bruno"); embedded with them alone, a long or unrelated
window also drowns what the turn itself says. The stored vector mixes the two embeddings:
CONTEXT_SHARE of (text + context) and the rest of the text alone, normalised. On the LoCoMo tuning
conversations (observations + turns, hybrid, novel hits) recall@10 rose from 0.808 (context
only) to 0.817-0.829 for shares 0.6-0.8 (docs/benchmarks.md). A fact's origin (the message it was
drawn from) joins the context here. A fact with neither keeps the embedding of its text.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvmem.embed.base import Embedder, l2_normalize
from kvmem.facts.text import search_text

CONTEXT_SHARE = 0.7


def fact_vectors(embedder: Embedder, texts: Sequence[str], contexts: Sequence[str],
                 origins: Sequence[str] | None = None) -> np.ndarray:
    """Unit vectors [n, dim] for n facts, in one `embed` call (n + the facts with a context or origin)."""
    origins = [""] * len(texts) if origins is None else origins
    if not len(texts) == len(contexts) == len(origins):
        raise ValueError(f"{len(texts)} texts but {len(contexts)} contexts and {len(origins)} origins")
    with_context = [i for i, (c, o) in enumerate(zip(contexts, origins)) if c or o]
    rows = embedder.embed([search_text(t, c, o) for t, c, o in zip(texts, contexts, origins)]
                          + [texts[i] for i in with_context])  # [n + m, dim]
    n = len(texts)
    vectors = rows[:n].copy()  # [n, dim]
    vectors[with_context] = CONTEXT_SHARE * rows[with_context] + (1 - CONTEXT_SHARE) * rows[n:]
    return l2_normalize(vectors)
