"""Median search latency at a few scope sizes: `ExactIndex.search`, and the hybrid search
(dense + BM25 fused) over the same facts. Run: python -m kvmem.index.latency [--depth N]

A quick read on whether exact search is still cheap enough at per-user sizes; not a test
(timings depend on the machine), so nothing here asserts.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np

from kvmem.config import RetrievalConfig
from kvmem.index.exact import ExactIndex
from kvmem.index.fusion import hybrid_search
from kvmem.index.lexical import LexicalIndex

DIM = 384  # all-MiniLM-L6-v2
SIZES = (100, 1_000, 10_000)
K = 10
FILTER = {"kind": {"in": ["pref", "fact"]}, "day": {"gte": "2024-06-01"}}


# The worst case for BM25: 30 words, so every query word is in ~40% of the facts.
WORDS = ("maya caroline melanie paint pottery race charity lake sunrise book concert band guitar camp trip "
         "dog cat school job bakery berlin porto marathon brother sister daughter birthday volvo japanese").split()


def zipf_words(rng: np.random.Generator, count: int, vocabulary: int = 20_000) -> list[str]:
    """Words drawn by frequency rank like natural text (Zipf, s=1.1): a query shares its rarer
    words with few facts, its common ones with many."""
    ranks = rng.zipf(1.1, count)
    return [f"z{r}" for r in np.minimum(ranks, vocabulary)]


def build(n: int, rng: np.random.Generator) -> tuple[ExactIndex, LexicalIndex, LexicalIndex]:
    index, lexical = ExactIndex(DIM), LexicalIndex()
    kinds = ["pref", "fact", "event", "misc"]
    metas = [{"kind": kinds[i % 4], "day": f"2024-{i % 12 + 1:02d}-01"} for i in range(n)]
    ids = [f"m{i}" for i in range(n)]
    index.add("user", ids, rng.normal(size=(n, DIM)).astype(np.float32), metas)
    # Fact-sized texts (12 words) over a small vocabulary: common words match many facts.
    texts = [" ".join(rng.choice(WORDS, 12)) + f" w{i % 997}" for i in range(n)]
    lexical.add("user", ids, texts, metas)
    zipf = LexicalIndex()
    zipf.add("user", ids, [" ".join(zipf_words(rng, 12)) for _ in range(n)], metas)
    return index, lexical, zipf


def median_us(fn: Callable[[np.ndarray], object], queries: np.ndarray, reps: int) -> float:
    """Median wall time of one call, in microseconds, after a short warm-up."""
    for q in queries[:5]:
        fn(q)
    times = []
    for i in range(reps):
        q = queries[i % len(queries)]
        start = time.perf_counter()
        fn(q)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m kvmem.index.latency")
    parser.add_argument("--depth", type=int, default=RetrievalConfig.depth,
                        help=f"fusion candidates per ranking (default: {RetrievalConfig.depth}, the service's)")
    depth = parser.parse_args().depth
    rng = np.random.default_rng(0)
    queries = rng.normal(size=(64, DIM)).astype(np.float32)  # [64, dim]
    print(f"ExactIndex.search, dim={DIM}, k={K}, one scope; median over many calls")
    print(f"filtered: {FILTER} (matches 1/4 of rows)")
    print(f"hybrid: dense top-{depth} and BM25 top-{depth} fused (3-word queries), no filter; texts of")
    print("  Zipf-distributed words (like natural text) and of a 30-word vocabulary (BM25's worst case)")
    print(f"{'vectors':>8} | {'unfiltered':>12} | {'filtered':>12} | {'hybrid Zipf':>12} | {'hybrid 30w':>12} | reps")
    print(f"{'-' * 8}-+-{'-' * 12}-+-{'-' * 12}-+-{'-' * 12}-+-{'-' * 12}-+-----")
    texts = [" ".join(rng.choice(WORDS, 3)) for _ in range(len(queries))]
    zipf_texts = [" ".join(zipf_words(rng, 3)) for _ in range(len(queries))]
    for n in SIZES:
        index, lexical, zipf = build(n, rng)
        reps = max(200, 200_000 // n)  # more repetitions where one call is short
        plain = median_us(lambda q: index.search("user", q, K), queries, reps)
        filtered = median_us(lambda q: index.search("user", q, K, FILTER), queries, min(reps, 500))
        natural = iter(zipf_texts * (reps + 10))
        typical = median_us(lambda q: hybrid_search(index, zipf, "user", q, next(natural), K, depth=depth),
                            queries, min(reps, 500))
        words = iter(texts * (reps + 10))
        fused = median_us(lambda q: hybrid_search(index, lexical, "user", q, next(words), K, depth=depth),
                          queries, min(reps, 500))
        print(f"{n:>8} | {plain:>9.1f} us | {filtered:>9.1f} us | {typical:>9.1f} us | {fused:>9.1f} us "
              f"| {reps}/{min(reps, 500)}")


if __name__ == "__main__":
    main()
