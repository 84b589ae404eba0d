"""Compare two `kvmem eval locomo` runs on the same questions, from their resume logs (JSONL).

Per pair of modes: first-token top-1 agreement and KL over the first run's top-20 logprobs (a token
missing from the second run's top 20 counted at its 20th logprob, as `eval locomo` bounds KL).
The same mode in both runs is the engine's run-to-run noise (bf16 sums change with batch
composition); kv in run B against kv in run A, paired per question, is what changed between them.

    .venv/bin/python scripts/eval_runs_compare.py A.jsonl B.jsonl [out.json]
"""

from __future__ import annotations

import json
import math
import random
import sys


def rows(path: str) -> dict[str, dict]:
    with open(path) as f:
        return {r["question"]: r for r in map(json.loads, f)}


def top(first: dict[str, float]) -> str:
    return max(first, key=first.get)


def margin(first: dict[str, float]) -> float:
    best, second = sorted(first.values())[-2:][::-1]
    return best - second


def kl(p: dict[str, float], q: dict[str, float]) -> float:
    floor = min(q.values())
    return sum(math.exp(lp) * (lp - q.get(t, floor)) for t, lp in p.items())


def pair(a: dict, b: dict, qs: list[str], ma: str, mb: str) -> dict:
    pairs = [(a[q][ma]["first"], b[q][mb]["first"]) for q in qs if ma in a[q] and mb in b[q]]
    return {"n": len(pairs), "top1_agree": sum(top(x) == top(y) for x, y in pairs) / len(pairs),
            "kl": sum(kl(x, y) for x, y in pairs) / len(pairs)}


def paired_kl_change(a: dict, b: dict, qs: list[str], resamples: int = 10_000) -> dict:
    """KL(text||kv) in run B minus run A, each within its own run, bootstrapped over questions."""
    d = [kl(b[q]["text"]["first"], b[q]["kv"]["first"]) - kl(a[q]["text"]["first"], a[q]["kv"]["first"]) for q in qs]
    rng = random.Random(0)
    means = sorted(sum(rng.choice(d) for _ in d) / len(d) for _ in range(resamples))
    return {"mean": sum(d) / len(d), "interval95": [means[int(0.025 * resamples)], means[int(0.975 * resamples)]]}


def compare(a: dict, b: dict) -> dict:
    qs = [q for q in a if q in b]
    out: dict = {"questions": len(qs)}
    for ma, mb in (("text", "text"), ("kv_plain", "kv_plain"), ("kv", "kv")):
        out[f"A {ma} vs B {mb}"] = pair(a, b, qs, ma, mb)
    out["KL(text||kv) B minus A, paired"] = paired_kl_change(a, b, qs)
    for name, r in (("A", a), ("B", b)):
        out[f"{name}: share of questions whose text top-1 leads by < 0.1 / 0.2 / 0.3 nats"] = [
            sum(margin(r[q]["text"]["first"]) < c for q in qs) / len(qs) for c in (0.1, 0.2, 0.3)]
        out[f"{name}: text top-1 margin where kv disagrees"] = [
            margin(r[q]["text"]["first"]) for q in qs if top(r[q]["kv"]["first"]) != top(r[q]["text"]["first"])]
    return out


if __name__ == "__main__":
    result = compare(rows(sys.argv[1]), rows(sys.argv[2]))
    result["command"] = "python scripts/eval_runs_compare.py " + " ".join(sys.argv[1:])
    print(json.dumps(result, indent=1))
    if len(sys.argv) > 3:
        with open(sys.argv[3], "w") as f:
            json.dump(result, f, indent=1)
