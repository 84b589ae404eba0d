"""Hybrid search latency at 10k facts in one scope: 12-word Zipf facts against the same facts with a
24-word origin appended to their BM25 text (as `add(..., origin=)` does), alternating in one process.

    .venv/bin/python scripts/latency_origin.py
"""

import numpy as np

from kvmem.index.fusion import hybrid_search
from kvmem.index.latency import DIM, K, build, median_us, zipf_words
from kvmem.index.lexical import LexicalIndex
rng = np.random.default_rng(0)
n = 10_000
index, _, zipf = build(n, rng)
ids = [f"m{i}" for i in range(n)]
texts = [" ".join(zipf_words(rng, 12)) for _ in range(n)]
plain, longer = LexicalIndex(), LexicalIndex()
plain.add("user", ids, texts)
longer.add("user", ids, [t + "\n" + " ".join(zipf_words(rng, 24)) for t in texts])
queries = rng.normal(size=(64, DIM)).astype(np.float32)
qtexts = [" ".join(zipf_words(rng, 3)) for _ in range(64)]
for rnd in range(3):
    for name, lex in (("12 words", plain), ("12 + 24-word origin", longer)):
        it = iter(qtexts * 600)
        us = median_us(lambda q: hybrid_search(index, lex, "user", q, next(it), K), queries, 500)
        print(f"round {rnd}: {name:22s} {us:8.1f} us", flush=True)
