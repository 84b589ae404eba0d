"""A fact's search vector against the embeddings it is made of (real MiniLM)."""

from __future__ import annotations

import numpy as np
import pytest

from kvmem.embed import MiniLMEmbedder
from kvmem.embed.fact import CONTEXT_SHARE, fact_vectors
from kvmem.facts.text import search_text

TEXTS = ["user: She walks him on the beach at sunrise.", "My dog is called Pepper.", "user: We went in June."]
CONTEXTS = ["user: My sister adopted a puppy called Bruno.", "", "assistant: When did you go to Lisbon?"]


@pytest.fixture(scope="module")
def embedder():
    return MiniLMEmbedder()


def test_mixes_text_with_context_and_text_alone(embedder):
    out = fact_vectors(embedder, TEXTS, CONTEXTS)
    alone = embedder.embed(TEXTS)
    with_context = embedder.embed([search_text(t, c) for t, c in zip(TEXTS, CONTEXTS)])
    assert out.shape == (3, embedder.dim) and out.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(out, axis=1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(out[1], alone[1], atol=1e-6)  # no context: the text's own vector
    for i in (0, 2):
        mixed = CONTEXT_SHARE * with_context[i] + (1 - CONTEXT_SHARE) * alone[i]
        np.testing.assert_allclose(out[i], mixed / np.linalg.norm(mixed), atol=1e-5)
        # closer to each of its parts than they are to each other
        assert min(out[i] @ alone[i], out[i] @ with_context[i]) > alone[i] @ with_context[i]


def test_calls_the_embedder_once(embedder, monkeypatch):
    calls = []
    real = embedder.embed
    monkeypatch.setattr(embedder, "embed", lambda texts, **kw: calls.append(len(texts)) or real(texts, **kw))
    fact_vectors(embedder, TEXTS, CONTEXTS)
    assert calls == [5]  # three texts with their contexts, then the two with a context alone
    assert fact_vectors(embedder, [], []).shape == (0, embedder.dim)


def test_texts_and_contexts_must_pair_up(embedder):
    with pytest.raises(ValueError, match="2 texts but 1 contexts"):
        fact_vectors(embedder, TEXTS[:2], CONTEXTS[:1])
