"""best_first: the ranking every index returns, against Python's sort of (score, id) pairs."""

import random

import numpy as np

from kvmem.index.base import best_first, top_k


def test_best_first_orders_by_value_then_id():
    rng = random.Random(0)
    for case in range(300):
        m = rng.randint(1, 60)
        pool = [0.5, 0.25, -1.0] if case % 2 else None  # half the cases full of ties
        values = np.array([rng.choice(pool) if pool else rng.random() for _ in range(m)])
        ids = [f"id{rng.randrange(1000):03d}" for _ in range(m)]
        expected = sorted(range(m), key=lambda i: (-values[i], ids[i]))
        got = best_first(values, ids.__getitem__).tolist()
        assert [(values[i], ids[i]) for i in got] == [(values[i], ids[i]) for i in expected], case


def test_top_k_is_the_head_of_the_full_ranking():
    rng = np.random.default_rng(1)
    for case in range(100):
        m = int(rng.integers(1, 300))
        scores = rng.integers(0, 5, m).astype(np.float32) if case % 2 else rng.random(m).astype(np.float32)
        ids = [f"f{j}" for j in rng.permutation(m)]
        k = int(rng.integers(1, m + 3))
        full = sorted(range(m), key=lambda i: (-scores[i], ids[i]))
        assert [(h.id, h.score) for h in top_k(scores, ids, k)] == [(ids[i], float(scores[i])) for i in full[:k]]
