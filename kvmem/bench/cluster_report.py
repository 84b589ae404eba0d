"""`kvmem bench cluster`'s output: the table (markdown), the JSON and the plot of a
cluster_sim.run() result."""

from __future__ import annotations

from pathlib import Path

from kvmem.bench.cluster_sim import POLICIES
from kvmem.bench.report import write_json


def plot(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no screen on servers
    import matplotlib.pyplot as plt

    rows = result["rows"]
    sizes = sorted({r["replicas"] for r in rows})
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    panels = (("ttft_p50", "TTFT p50 (s)"), ("ttft_p99", "TTFT p99 (s)"), ("resident_hit", "resident-hit rate"))
    for ax, (key, label) in zip(axes, panels):
        for policy, color in zip(POLICIES, ("tab:blue", "tab:orange")):
            for change, style in (("steady", "-"), ("deaths", "--")):
                ys = [next(r[key] for r in rows if r["replicas"] == n and r["policy"] == policy
                           and r["change"] == change) for n in sizes]
                name = policy + (f", {result['death_share']:.0%} die" if change == "deaths" else "")
                ax.plot(sizes, ys, style, marker="o", color=color, label=name)
        ax.set(xscale="log", xlabel="replicas", ylabel=label, xticks=sizes, xticklabels=[str(n) for n in sizes])
        if key != "resident_hit":
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    sc = result["scenario"]
    fig.suptitle(f"Simulated cluster, k={sc['k']}, {sc['rate_per_replica']} chats/s per replica, user Zipf "
                 f"{sc['user_zipf']}, compute x{result['compute_speedup']:g}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report(result: dict, out: Path) -> str:
    """Writes out.json and out.png (TTFT p50/p99 and resident-hit rate by size, per policy, steady
    and with deaths); -> the table, in markdown."""
    write_json(result, out.parent / f"{out.name}.json")  # not with_suffix: names like cluster-zipf0.5
    plot(result, out.parent / f"{out.name}.png")
    rows = result["rows"]
    head = ("| replicas | died / joined | policy | TTFT p50 | TTFT p99 | resident hit | RAM hit | pulls/chat | "
            "max/mean load | users moved (off dead) | cut / re-sent |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(f"| {r['replicas']} | {r['deaths']} / {r['joins']} | {r['policy']} "
                     f"| {r['ttft_p50'] * 1e3:,.0f} ms | {r['ttft_p99'] * 1e3:,.0f} ms "
                     f"| {r['resident_hit']:.3f} | {r['ram_hit']:.3f} | {r['pulls_per_chat']:.1f} "
                     f"| {r['load_max_over_mean']:.2f} "
                     f"| {r['users_moved']} ({r['users_moved_off_dead']}) | {r['cut']} / {r['resent']} |")
    return "\n".join(lines)
