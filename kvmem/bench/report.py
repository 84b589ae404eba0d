"""Writing benchmark results: JSON beside a PNG plot, and summary statistics."""

from __future__ import annotations

import json
import statistics
from pathlib import Path


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    idx = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[idx]


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "p90": percentile(values, 90), "n": len(values)}


def write_json(result: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    return path


def plot_lines(path: Path, x: list, series: dict[str, list[float]], xlabel: str, ylabel: str, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no screen on servers
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, ys in series.items():
        ax.plot(x, ys, marker="o", label=name)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
