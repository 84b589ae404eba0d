"""The selective-recompute curve (issue 40): first-token KL and agreement against text prefill
as the recomputed share of fact tokens grows, per rule, without and with the reader's KV map.

Reads the lab sweeps scripts/recompute_lab.py wrote (the 2.5-15% budgets and the 25-100% curve,
the same 45 tuning-conversation chats) and draws one figure:

    python scripts/recompute_plot.py docs/results/recompute-lab-tune.json \
        docs/results/recompute-lab-tune-curve.json --out docs/results/recompute-lab-curve.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RULES = ("deviation", "first", "last", "oracle", "best-last")


def curves(files: list[Path]) -> dict[tuple[str, str], dict[float, dict[str, float]]]:
    """(map, rule) -> {budget: row}, every file's rows merged; budget 0 (plain injection) in each rule."""
    out: dict[tuple[str, str], dict[float, dict[str, float]]] = {}
    plain: dict[str, dict[str, float]] = {}
    for path in files:
        for name, row in json.loads(path.read_text())["rows"].items():
            kv_map, rule, budget = name.split("/")
            if rule == "none":
                plain[kv_map] = row
            else:
                out.setdefault((kv_map, rule), {})[float(budget)] = row
    for (kv_map, _), points in out.items():
        if kv_map in plain:
            points.setdefault(0.0, plain[kv_map])
    return out


def draw(data: dict, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no screen on servers
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7), sharex=True)
    for col, (kv_map, title) in enumerate((("off", "without the KV map"), ("on", "with the shipped KV map"))):
        for rule in RULES:
            points = data.get((kv_map, rule))
            if not points:
                continue
            xs = sorted(points)
            for row, metric in enumerate(("first_kl", "first_agree")):
                axes[row][col].plot([100 * x for x in xs], [points[x][metric] for x in xs], marker="o", label=rule)
        axes[0][col].set_title(title)
        axes[0][col].axhline(0.02, color="red", linestyle="--", linewidth=1)  # issue 40's targets (engine)
        axes[1][col].axhline(0.95, color="red", linestyle="--", linewidth=1)
        axes[1][col].set_xlabel("fact tokens recomputed (%)")
    axes[0][0].set_ylabel("first-token KL(text || kv)")
    axes[1][0].set_ylabel("first-token top-1 agreement")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.axvline(15, color="grey", linestyle=":", linewidth=1)  # CacheBlend's budget; red: the targets
    axes[0][1].legend()
    fig.suptitle("Selective recompute, lab (SmolLM2-135M fp32, 45 tuning-conversation chats, k=10)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", type=Path, nargs="+", help="scripts/recompute_lab.py results")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    print(draw(curves(args.files), args.out))


if __name__ == "__main__":
    main()
