"""Summarising LoCoMo evaluation rows per category, with bootstrap 95% intervals."""

from __future__ import annotations

import json
import math
from pathlib import Path

from kvmem.bench.metrics import bootstrap_ci, ratio_ci

MODES = ("text", "kv", "off")


def summarize(rows: list[dict]) -> dict:
    groups = {"overall": rows}
    for cat in sorted({r["category"] for r in rows}):
        groups[f"category {cat}"] = [r for r in rows if r["category"] == cat]
    return {name: _group(g) for name, g in groups.items() if g}


def _group(rows: list[dict]) -> dict:
    out = {"n": len(rows)}
    for mode in MODES:
        out[f"f1_{mode}"] = bootstrap_ci([r[mode]["f1"] for r in rows])
        out[f"ll_{mode}"] = bootstrap_ci([r[mode]["ll"] for r in rows])
    out["f1_retention_kv"] = ratio_ci([r["kv"]["f1"] - r["off"]["f1"] for r in rows],
                                      [r["text"]["f1"] - r["off"]["f1"] for r in rows])
    out["ll_retention_kv"] = ratio_ci([r["kv"]["ll"] - r["off"]["ll"] for r in rows],
                                      [r["text"]["ll"] - r["off"]["ll"] for r in rows])
    out["top1_agree"] = bootstrap_ci([float(r["top1_agree"]) for r in rows if r["top1_agree"] is not None])
    out["kl_text_kv"] = bootstrap_ci([r["kl_text_kv"] for r in rows])
    out["recall_at_k"] = bootstrap_ci([r["recall"] for r in rows if r["recall"] is not None])
    return out


def _ci(t) -> str:
    mean, lo, hi = t
    return "n/a" if math.isnan(mean) else f"{mean:.3f} [{lo:.3f}, {hi:.3f}]"


def markdown(summary: dict, title: str) -> str:
    lines = [f"### {title}", "",
             "| group | n | F1 text | F1 kv | F1 no-memory | F1 retention kv | LL text | LL kv | LL no-memory | "
             "LL retention kv | top-1 agree | KL(text‖kv) | recall@k |", "|" + "---|" * 13]
    for name, g in summary.items():
        lines.append(f"| {name} | {g['n']} | {_ci(g['f1_text'])} | {_ci(g['f1_kv'])} | {_ci(g['f1_off'])} | "
                     f"{_ci(g['f1_retention_kv'])} | "
                     f"{_ci(g['ll_text'])} | {_ci(g['ll_kv'])} | {_ci(g['ll_off'])} | {_ci(g['ll_retention_kv'])} | "
                     f"{_ci(g['top1_agree'])} | {_ci(g['kl_text_kv'])} | {_ci(g['recall_at_k'])} |")
    return "\n".join(lines)


def write(rows: list[dict], cfg, out: Path) -> str:
    """Summarise rows into out/<name>.json and out/<name>.md; returns the markdown table."""
    summary = summarize(rows)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{cfg.name}.json").write_text(json.dumps({"config": {**cfg.__dict__, "data": str(cfg.data), "window": cfg.window_size},
                                                       "summary": summary}, indent=2))
    table = markdown(summary, cfg.name)
    (out / f"{cfg.name}.md").write_text(table + "\n")
    return table
