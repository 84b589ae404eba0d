"""Replay `kvmem bench cache`'s request stream through the eviction policy alone (no engine).

Shows where the disk tier's hit rate and re-encode rate settle for a budget, which the engine
bench (150 requests per budget on a 2-core host) does not reach. Every blob is one size; an
evicted fact is re-encoded at once when `worth_readmitting` says so.

    python scripts/cache_policy_replay.py --requests 2000
"""

from __future__ import annotations

import argparse

from kvmem.bench.cache import requests
from kvmem.kv.budget import DiskBudget


def replay(share: float, users: int, facts: int, k: int, s: float, n: int, warmup: int, seed: int) -> tuple[float, float]:
    """-> (disk hit rate, re-encodes per chat) over the requests after `warmup`."""
    budget = DiskBudget(int(share * users * facts))
    for u in range(users):  # all encoded, then the budget applies (as at a start-up in storage order)
        for f in range(facts):
            budget.admit((u, f), u, 1)
    hits = misses = reencodes = 0
    for i, (u, chosen, _) in enumerate(requests(warmup + n, users, facts, k, s, 1, seed)):
        ids = [(u, f) for f in chosen]
        held = [budget.holds(x) for x in ids]
        budget.touch(ids)
        for x, h in zip(ids, held):
            if not h and budget.worth_readmitting(x, u):
                budget.admit(x, u, 1)
                reencodes += i >= warmup
        if i >= warmup:
            hits, misses = hits + sum(held), misses + len(held) - sum(held)
    return hits / (hits + misses), reencodes / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--users", type=int, default=30)
    p.add_argument("--facts-per-user", type=int, default=8)
    p.add_argument("-k", type=int, default=3)
    p.add_argument("--zipf", type=float, default=1.0)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    for share in (0.5, 0.2, 0.1):
        hit, reenc = replay(share, args.users, args.facts_per_user, args.k, args.zipf, args.requests, args.warmup, args.seed)
        print(f"budget {share:.0%}: disk hit rate {hit:.2f}, re-encodes per chat {reenc:.3f}")


if __name__ == "__main__":
    main()
