"""The NumPy MiniLM (what `kvmem search` embeds queries with) against the torch one that made the
stored vectors: the same vectors to float32 rounding, for short, long, padded and odd texts."""

from __future__ import annotations

import subprocess
import sys

import numpy as np

from kvmem.embed.minilm import MiniLMEmbedder
from kvmem.embed.numpy_minilm import NumpyMiniLMEmbedder

TEXTS = ["What is my dog called?", "My dog is called Biscuit and loves carrots.", "x",
         "A sentence long enough to be cut at the model's 256 tokens. " * 40,
         "Ünïcödé — emoji 🐶, 中文, and tabs\tand\nnewlines", "[9 May 2023] Caroline: I went to the LGBTQ support group."]


def test_numpy_vectors_are_torchs():
    a = NumpyMiniLMEmbedder(batch_size=4).embed(TEXTS)  # batches of unequal lengths: padding is masked
    b = MiniLMEmbedder().embed(TEXTS)
    assert a.shape == b.shape == (len(TEXTS), 384) and a.dtype == np.float32
    assert np.abs(a - b).max() < 1e-5, np.abs(a - b).max()
    assert np.allclose(np.linalg.norm(a, axis=1), 1.0, atol=1e-6)


def test_it_imports_no_torch():
    code = ("import sys; from kvmem.embed.numpy_minilm import NumpyMiniLMEmbedder as E; E().embed(['hi']); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
