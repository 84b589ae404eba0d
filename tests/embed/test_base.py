"""The Embedder base class with a fake model: batching, normalisation, input checks."""

from __future__ import annotations

import numpy as np
import pytest

from kvmem.embed import Embedder
from kvmem.errors import InvalidInputError


class FakeEmbedder(Embedder):
    name, dim = "fake", 3

    def __init__(self, batch_size: int = 4) -> None:
        super().__init__(batch_size)
        self.batches: list[int] = []

    def _embed_batch(self, texts: list[str]) -> np.ndarray:
        self.batches.append(len(texts))
        return np.array([[len(t), 1.0, 0.0] for t in texts], dtype=np.float64)  # not normalised


def test_batches_and_normalises():
    e = FakeEmbedder(batch_size=4)
    out = e.embed(["a", "bb", "ccc", "dddd", "eeeee", "f"])
    assert e.batches == [4, 2]
    assert out.dtype == np.float32 and out.shape == (6, 3)
    np.testing.assert_allclose(np.linalg.norm(out, axis=1), 1.0, rtol=1e-6)
    e.embed(["a"] * 5, batch_size=2)
    assert e.batches[2:] == [2, 2, 1]


def test_empty_list_skips_the_model():
    e = FakeEmbedder()
    out = e.embed([])
    assert out.shape == (0, 3) and out.dtype == np.float32 and e.batches == []


@pytest.mark.parametrize(
    "texts, message, param",
    [
        ("hello", "takes a list of strings, got str", "texts"),
        (None, "takes a list of strings, got NoneType", "texts"),
        (["ok", 3], "text #1 is int, not str", "texts[1]"),
        (["ok", "  "], "text #1 is empty", "texts[1]"),
    ],
)
def test_bad_texts(texts, message, param):
    with pytest.raises(InvalidInputError, match=message) as err:
        FakeEmbedder().embed(texts)
    assert err.value.param == param


@pytest.mark.parametrize("size", [0, -1, 2.5, True])
def test_bad_batch_size(size):
    with pytest.raises(InvalidInputError, match="batch_size must be an int >= 1") as err:
        FakeEmbedder(batch_size=size)
    assert err.value.param == "batch_size"
    with pytest.raises(InvalidInputError, match="batch_size must be an int >= 1"):
        FakeEmbedder().embed(["a"], batch_size=size)
