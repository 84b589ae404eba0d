"""The fidelity curve as measured: answers against the engine's own noise floor, and the TTFT kept.

    python scripts/fidelity_curve.py            # prints the table, draws docs/results/fidelity-points.png

Two hosts ran it: a 2-core AMD EPYC with AVX-512 bf16, where vLLM's prefix-cache hit is bit-exact
and text prefill is slow next to injection, and a 2-core Intel Xeon with AMX, where prefill is
~2x faster and the engine's own noise is not zero.

EPYC: every point's answers come from `kvmem eval locomo` over all 650 questions of categories 1-4
of the reporting conversations (conv-42/43/44/47), k=10 observations, the shipped map, each
text-facts point from a run of its own (`--no-noise-floor`); same answer is read against the
noise floor of the first run (text mode's second pass over the same 650 questions). An "exact"
ran on 255 of those questions, read against its own floor on those 255.

Xeon: one run over conv-42/43/47 (527 questions) answers fast, balanced and exact over the same
text, no-memory and plain passes (`--points text-facts-4,exact`), with its own noise floor.

TTFT: one `kvmem bench ttft --points ...` run per host (k=50, 5 repetitions) times every point in
the same repetitions as plain injection of every fact, so "gain kept" is (text/kv at the point) /
(text/kv with every fact injected), side by side. Points whose file is missing are listed as not
measured.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
RUN = "locomo-observations-w0-k10-conv-42+conv-43+conv-44+conv-47"
EXACT = "locomo-observations-w0-k10-limit85-conv-42+conv-43+conv-44-recompute-first-1.json"
EXACT_FLOOR = 0.753  # text vs its second pass on the exact run's 255 questions (benchmarks.md)
XEON_RUN = "locomo-observations-w0-k10-conv-42+conv-43+conv-47-xeon.json"  # --points text-facts-4,exact

TTFT = "ttft-fidelity-curve.json"  # EPYC: one bench ttft --points run, every point in the same repetitions
TTFT_XEON = "ttft-fidelity-curve-amx.json"  # the same on the Xeon with AMX

# label, eval file, which KV column, the point's name in the TTFT runs ("plain"/"fast": their own columns)
POINTS = [
    ("plain KV (no map)", f"{RUN}.json", "kv_plain", "plain"),
    ("fast (default): the map", f"{RUN}.json", "kv", "fast"),
    ("last 1 fact as text", f"{RUN}-text-facts-1.json", "kv", "text-facts-1"),
    ("last 2 facts as text", f"{RUN}-text-facts-2.json", "kv", "text-facts-2"),
    ("best-scored 2 as text", f"{RUN}-text-facts-2-relevant.json", "kv", "text-facts-2"),
    ("balanced: last 4 facts as text", f"{RUN}-text-facts-4.json", "kv", "text-facts-4"),
    ("recompute 5% first", None, "kv", "first-0.05"),
    ("recompute 15% first (EPIC)", None, "kv", "first-0.15"),
    ("recompute 30% first", None, "kv", "first-0.3"),
    ("recompute 15% deviation (CacheBlend)", None, "kv", "deviation-0.15"),
    ("recompute 15% progressive", None, "kv", "progressive-0.15"),
    ("recompute 15% global", None, "kv", "global-0.15"),
    ("exact (100%), 255 questions", EXACT, "kv", "exact"),
    ("Xeon: fast (the map)", XEON_RUN, "kv", "fast"),
    ("Xeon: balanced (last 4 as text)", XEON_RUN, "kv@text-facts-4", "text-facts-4"),
    ("Xeon: exact (100%)", XEON_RUN, "kv@exact", "exact"),
]


def gain_kept(point: str, ttft: str, k: int = 50) -> float | None:
    """The share of plain injection's text/kv at k that the point keeps, in the same repetitions."""
    path = RESULTS / ttft
    if point == "fast":
        return 1.0
    if not path.exists():
        return None
    row = next(r for r in json.loads(path.read_text())["rows"] if r["k"] == k)
    if point == "plain":  # without the map, against with it (the map's own cost, inverted)
        return row["kv"]["median"] / row["kv_plain"]["median"]
    found = row.get("points", {}).get(point)
    return None if found is None else found["share"]


def answers(name: str | None, column: str, floor: float) -> dict | None:
    """A point's answer measures from an eval's summary; same answer over the run's own noise
    floor where it has one, else over `floor` (the 650-question run's)."""
    path = RESULTS / name if name else None
    if path is None or not path.exists():
        return None
    o = json.loads(path.read_text())["summary"]["overall"]
    suffix = column.removeprefix("kv")  # "", "_plain" or "@<point>"
    if f"f1_retention_kv{suffix}" not in o:
        return None
    floor = EXACT_FLOOR if name == EXACT else o.get("same_answer_noise", [floor])[0]
    return {"n": o["n"], "f1_retention": o[f"f1_retention_kv{suffix}"], "first_token": o[f"top1_agree{suffix}"][0],
            "kl": o[f"kl_text_kv{suffix}"][0], "same": o[f"same_answer{suffix}"], "floor": floor,
            "rel": [x / floor for x in o[f"same_answer{suffix}"]]}


def table() -> tuple[str, list[tuple[str, float | None, dict | None]]]:
    floor = json.loads((RESULTS / f"{RUN}.json").read_text())["summary"]["overall"]["same_answer_noise"][0]
    lines = ["| point | n | F1 retention [95% CI] | first token as text's | KL | same answer | noise floor | "
             "/ noise floor | TTFT gain kept, k=50: EPYC | Xeon AMX |", "|---|---|---|---|---|---|---|---|---|---|"]
    rows = []
    for label, eval_file, column, point in POINTS:
        a = answers(eval_file, column, floor)
        kept = {host: gain_kept(point, ttft) for host, ttft in (("epyc", TTFT), ("xeon", TTFT_XEON))}
        rows.append((label, kept["xeon" if label.startswith("Xeon") else "epyc"], a))
        keep = " | ".join("-" if kept[h] is None else f"{kept[h]:.2f}" for h in ("epyc", "xeon"))
        if a is None:
            lines.append(f"| {label} | not measured | | | | | | | {keep} |")
            continue
        f1 = a["f1_retention"]
        lines.append(f"| {label} | {a['n']} | {f1[0]:.3f} [{f1[1]:.3f}, {f1[2]:.3f}] | {a['first_token']:.3f} | "
                     f"{a['kl']:.3f} | {a['same'][0]:.3f} | {a['floor']:.3f} | "
                     f"{a['rel'][0]:.2f} [{a['rel'][1]:.2f}, {a['rel'][2]:.2f}] | {keep} |")
    return "\n".join(lines), rows


def plot(rows, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, kept, a in rows:
        if kept is None or a is None:
            continue
        for ax, y in ((left, a["rel"]), (right, a["f1_retention"])):
            ax.errorbar(kept, y[0], yerr=[[y[0] - y[1]], [y[2] - y[0]]], fmt="o", capsize=3)
            ax.annotate(label, (kept, y[0]), textcoords="offset points", xytext=(5, 3), fontsize=7)
    left.axhline(1.0, ls="--", c="grey")
    left.axhline(0.8, ls=":", c="red")
    left.set_ylabel("same answer as text / text's own (noise floor)")
    right.axhline(0.95, ls=":", c="red")
    right.axhline(1.0, ls="--", c="grey")
    right.set_ylabel("F1 retention over no memory")
    for ax in (left, right):
        ax.axvline(0.6, ls=":", c="red")
        ax.set_xlim(0, 1.15)
        ax.set_xlabel("share of plain injection's TTFT gain kept, k=50 (side by side)")
    fig.suptitle("Fidelity curve, SmolLM2-135M, LoCoMo reporting questions; Xeon points: their own run and "
                 "TTFT (red: issue 51's targets)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=RESULTS / "fidelity-points.png")
    args = ap.parse_args()
    text, rows = table()
    print(text, flush=True)
    plot(rows, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
