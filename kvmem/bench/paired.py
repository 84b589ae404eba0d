"""Two `kvmem eval locomo` runs compared question by question: B - A per metric, with a paired
bootstrap 95% interval. Run: python -m kvmem.bench.paired A.jsonl B.jsonl [out.json]
`--plain RUN.jsonl [out.json]`: one run with a reader adapter, its KV mode without the adapter
(kv_plain) as A and with it (kv) as B, on the same questions and engine.

The runs' own intervals overlap when the change is small against the spread between questions;
pairing on the same questions removes that spread (the logs sit in <home>/eval/).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

METRICS = ("recall", "text.f1", "kv.f1", "kv_plain.f1", "off.f1", "text.ll", "kv.ll", "kv_plain.ll",
           "top1_agree", "kl_text_kv")
RESAMPLES = 10_000


def _value(row: dict, metric: str) -> float | None:
    if "." not in metric:
        value = row.get(metric)
    else:
        mode, field = metric.split(".")
        value = row.get(mode, {}).get(field)
    return None if value is None else float(value)


def compare(a: list[dict], b: list[dict], seed: int = 0) -> dict:
    """Per metric over the questions both logs answered (by key): means, B - A, its interval,
    and how many questions went up and down."""
    by_key = {r["key"]: r for r in a}
    pairs = [(by_key[r["key"]], r) for r in b if r["key"] in by_key]
    rng = np.random.default_rng(seed)
    out = {}
    for metric in METRICS:
        x = np.array([(_value(ra, metric), _value(rb, metric)) for ra, rb in pairs
                      if _value(ra, metric) is not None and _value(rb, metric) is not None], float)  # [n, 2]
        if not len(x):
            continue
        d = x[:, 1] - x[:, 0]  # [n]
        means = d[rng.integers(0, len(d), (RESAMPLES, len(d)))].mean(axis=1)  # [resamples]
        out[metric] = {"a": x[:, 0].mean(), "b": x[:, 1].mean(), "diff": d.mean(),
                       "ci": np.percentile(means, [2.5, 97.5]).tolist(),
                       "up": int((d > 0).sum()), "down": int((d < 0).sum()), "n": len(d)}
    return {"n": len(pairs), "metrics": out}


def plain_as_kv(rows: list[dict]) -> list[dict]:
    """A run's rows with KV mode read without the reader adapter in kv's place."""
    if not all("kv_plain" in r for r in rows):
        raise SystemExit("--plain needs a run with a reader adapter (its rows carry kv_plain)")
    return [{**r, "kv": r["kv_plain"], "top1_agree": r["top1_agree_plain"], "kl_text_kv": r["kl_text_kv_plain"]}
            for r in rows]


def main(argv: list[str]) -> None:
    within = argv[:1] == ["--plain"]
    paths = argv[1:] if within else argv
    if len(paths) not in ((1, 2) if within else (2, 3)):
        raise SystemExit("usage: python -m kvmem.bench.paired A.jsonl B.jsonl [out.json] | --plain RUN.jsonl [out.json]")
    if within:
        paths = [paths[0], *paths]  # the run is both A (read without the adapter) and B
    a, b = ([json.loads(line) for line in Path(p).open()] for p in paths[:2])
    if within:
        a = plain_as_kv(a)
    result = {"a": Path(paths[0]).name + (" (kv_plain as kv)" if within else ""), "b": Path(paths[1]).name,
              **compare(a, b)}
    print(f"{result['n']} questions in both")
    for metric, m in result["metrics"].items():
        print(f"{metric:12s} A {m['a']:.3f}  B {m['b']:.3f}  B-A {m['diff']:+.3f} "
              f"[{m['ci'][0]:+.3f}, {m['ci'][1]:+.3f}]  up {m['up']} down {m['down']} of {m['n']}")
    if len(paths) == 3:
        Path(paths[2]).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
