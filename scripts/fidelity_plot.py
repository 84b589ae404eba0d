"""The fidelity points as measured: TTFT speed-up at k=50 against answers relative to the noise floor.

    python scripts/fidelity_plot.py --out docs/results/fidelity-points.png

Reads the results files docs/benchmarks.md ("Fidelity points") cites: the n = 650 eval (fast,
plain KV, and the noise floor), the n = 255 exact eval (read against the n = 650 run's floor on
the same questions: the row it prints), and one `bench ttft` per point. Balanced has a TTFT but
no answer run at n >= 500, so it is drawn on the speed axis only.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
EVAL = "locomo-observations-w0-k10-conv-42+conv-43+conv-44+conv-47.json"
EXACT_REL = 1.14  # same answer / noise floor on the exact run's 255 questions (benchmarks.md)


def speedup(name: str, k: int = 50, plain: bool = False) -> float:
    rows = json.loads((RESULTS / name).read_text())["rows"]
    row = next(r for r in rows if r["k"] == k)
    return row["text"]["median"] / row["kv_plain" if plain else "kv"]["median"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=RESULTS / "fidelity-points.png")
    args = ap.parse_args()
    overall = json.loads((RESULTS / EVAL).read_text())["summary"]["overall"]
    points = {"plain KV (no map)": (speedup("ttft-fidelity-fast.json", plain=True), overall["same_answer_rel_plain"][0]),
              "fast (default)": (speedup("ttft-fidelity-fast.json"), overall["same_answer_rel"][0]),
              "exact": (speedup("ttft-fidelity-exact.json"), EXACT_REL)}
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, (x, y) in points.items():
        ax.scatter(x, y)
        ax.annotate(name, (x, y), textcoords="offset points", xytext=(6, 4))
    balanced = speedup("ttft-fidelity-balanced.json")
    ax.axvline(balanced, ls=":", c="grey")
    ax.annotate("balanced\n(answers not\nmeasured)", (balanced, 0.45), fontsize=8, textcoords="offset points",
                xytext=(4, 0))
    ax.axhline(1.0, ls="--", c="grey")
    ax.axhline(0.8, ls=":", c="red")
    ax.set_xlim(0, 9)
    ax.set_ylim(0, 1.3)
    ax.set_xlabel("TTFT text / kv at k=50 (one bench ttft per point, under load)")
    ax.set_ylabel("same answer as text / text's own (noise floor)")
    ax.set_title("Fidelity points, SmolLM2-135M, LoCoMo reporting questions", fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
