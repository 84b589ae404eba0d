"""Summarising LoCoMo evaluation rows per category, with bootstrap 95% intervals."""

from __future__ import annotations

import json
import math
from pathlib import Path

from kvmem.bench.metrics import bootstrap_ci, ratio_ci

MODES = ("text", "kv", "off")
VARIANTS = {"kv_plain": "without the reader adapter", "kv_norc": "without recompute (plain injection)"}


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
    out.update(_kv_fidelity(rows, "kv", ""))
    for mode in VARIANTS:  # kv without the reader adapter / without recompute, same questions
        if all(mode in r for r in rows):
            out[f"f1_{mode}"] = bootstrap_ci([r[mode]["f1"] for r in rows])
            out[f"ll_{mode}"] = bootstrap_ci([r[mode]["ll"] for r in rows])
            out.update(_kv_fidelity(rows, mode, mode.removeprefix("kv")))
    for mode in codec_modes(rows):  # kv_<codec>: the same KV re-coded, same questions
        out[f"f1_{mode}"] = bootstrap_ci([r[mode]["f1"] for r in rows])
        out[f"ll_{mode}"] = bootstrap_ci([r[mode]["ll"] for r in rows])
        out.update(_kv_fidelity(rows, mode, mode.removeprefix("kv")))
        lossless = f"top1_agree_lossless{mode.removeprefix('kv')}"  # vs the lossless blobs' first token
        out[lossless] = bootstrap_ci([float(r[lossless]) for r in rows if r.get(lossless) is not None])
    for mode in point_modes(rows):  # kv@<point>: KV mode at a fidelity point, same questions
        out[f"f1_{mode}"] = bootstrap_ci([r[mode]["f1"] for r in rows])
        out[f"ll_{mode}"] = bootstrap_ci([r[mode]["ll"] for r in rows])
        out.update(_kv_fidelity(rows, mode, mode.removeprefix("kv")))
    out["recall_at_k"] = bootstrap_ci([r["recall"] for r in rows if r["recall"] is not None])
    if all("text2" in r for r in rows):
        kv_modes = ("kv", *VARIANTS, *codec_modes(rows), *point_modes(rows))
        out.update(_noise_floor(rows, [m for m in kv_modes if f"f1_{m}" in out]))
    return out


def _noise_floor(rows: list[dict], kv_modes: list[str]) -> dict:
    """Text mode against its own second pass (bench/noise_floor.py), and each KV mode's same-answer
    rate relative to it (1.0: KV parts from text no more often than text parts from itself)."""
    noise = [float(r["same_answer_text2"]) for r in rows]
    out = {"same_answer_noise": bootstrap_ci(noise),
           "top1_agree_noise": bootstrap_ci([float(r["top1_agree_text2"]) for r in rows
                                             if r["top1_agree_text2"] is not None]),
           "kl_noise": bootstrap_ci([r["kl_text_text2"] for r in rows]),
           "f1_text2": bootstrap_ci([r["text2"]["f1"] for r in rows]),
           "f1_diff_noise": bootstrap_ci([r["text2"]["f1"] - r["text"]["f1"] for r in rows])}
    for mode in kv_modes:
        s = mode.removeprefix("kv")
        out[f"same_answer_rel{s}"] = ratio_ci([float(r[f"same_answer{s}"]) for r in rows], noise)
    return out


def codec_modes(rows: list[dict]) -> list[str]:
    """The kv_<codec> modes every row has (an eval run with --codecs)."""
    modes = [m for m in rows[0] if m.startswith("kv_") and m not in VARIANTS and isinstance(rows[0][m], dict)]
    return [m for m in modes if all(m in r for r in rows)]


def point_modes(rows: list[dict]) -> list[str]:
    """The kv@<point> modes every row has (eval locomo --points), in the order first logged."""
    return [m for m in rows[0] if m.startswith("kv@") and all(m in r for r in rows)]


def _kv_fidelity(rows: list[dict], mode: str, suffix: str) -> dict:
    """Retention of text's gain over no memory, first-token agreement and KL, for one KV mode."""
    return {
        f"f1_retention_kv{suffix}": ratio_ci([r[mode]["f1"] - r["off"]["f1"] for r in rows],
                                             [r["text"]["f1"] - r["off"]["f1"] for r in rows]),
        f"ll_retention_kv{suffix}": ratio_ci([r[mode]["ll"] - r["off"]["ll"] for r in rows],
                                             [r["text"]["ll"] - r["off"]["ll"] for r in rows]),
        f"top1_agree{suffix}": bootstrap_ci([float(r["top1_agree" + suffix]) for r in rows
                                             if r["top1_agree" + suffix] is not None]),
        f"kl_text_kv{suffix}": bootstrap_ci([r["kl_text_kv" + suffix] for r in rows]),
        # Runs from before these two were recorded have neither: nan.
        f"top1_agree_tie{suffix}": bootstrap_ci([float(r["top1_agree_tie" + suffix]) for r in rows
                                                 if r.get("top1_agree_tie" + suffix) is not None]),
        f"same_answer{suffix}": bootstrap_ci([float(r["same_answer" + suffix]) for r in rows
                                              if r.get("same_answer" + suffix) is not None]),
    }


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
    lines += ["", "First token and whole answer against text mode's (tie-aware: text's top two within bf16 "
              "resolution count either way):", "", "| group | variant | top-1 agree | tie-aware | same answer |",
              "|" + "---|" * 5]
    for mode in ("kv", *VARIANTS):
        s = mode.removeprefix("kv")
        lines += [f"| {name} | {mode} | {_ci(g['top1_agree' + s])} | {_ci(g['top1_agree_tie' + s])} | "
                  f"{_ci(g['same_answer' + s])} |" for name, g in summary.items() if f"f1_{mode}" in g]
    if "same_answer_noise" in summary["overall"]:
        lines += _noise_lines(summary)
    for mode, what in VARIANTS.items():
        if not all(f"f1_{mode}" in g for g in summary.values()):
            continue
        s = mode.removeprefix("kv")
        lines += ["", f"KV mode {what}, same questions and engine:", "",
                  f"| group | F1 {mode} | F1 retention | LL {mode} | LL retention | top-1 agree | KL(text‖kv) |",
                  "|" + "---|" * 7]
        lines += [f"| {name} | {_ci(g[f'f1_{mode}'])} | {_ci(g[f'f1_retention_kv{s}'])} | {_ci(g[f'll_{mode}'])} | "
                  f"{_ci(g[f'll_retention_kv{s}'])} | {_ci(g[f'top1_agree{s}'])} | {_ci(g[f'kl_text_kv{s}'])} |"
                  for name, g in summary.items()]
    lines += _point_lines(summary["overall"])
    codecs = [m.removeprefix("f1_kv_") for m in summary["overall"]
              if m.startswith("f1_kv_") and m.removeprefix("f1_") not in VARIANTS]
    if codecs:
        lines += ["", "KV mode per codec (the same blobs re-coded, read as served), overall:", "",
                  "| codec | F1 kv | F1 retention | LL kv | LL retention | top-1 agree | KL(text‖kv) | top-1 agree vs none |",
                  "|" + "---|" * 8]
        g = summary["overall"]
        lines += [f"| none | {_ci(g['f1_kv'])} | {_ci(g['f1_retention_kv'])} | {_ci(g['ll_kv'])} | "
                  f"{_ci(g['ll_retention_kv'])} | {_ci(g['top1_agree'])} | {_ci(g['kl_text_kv'])} | 1 |"]
        lines += [f"| {c} | {_ci(g[f'f1_kv_{c}'])} | {_ci(g[f'f1_retention_kv_{c}'])} | {_ci(g[f'll_kv_{c}'])} | "
                  f"{_ci(g[f'll_retention_kv_{c}'])} | {_ci(g[f'top1_agree_{c}'])} | {_ci(g[f'kl_text_kv_{c}'])} | "
                  f"{_ci(g[f'top1_agree_lossless_{c}'])} |"
                  for c in codecs]
    return "\n".join(lines)


def _point_lines(g: dict) -> list[str]:
    """KV mode at each fidelity point (eval locomo --points), overall, beside the configured KV mode."""
    points = [m.removeprefix("f1_kv@") for m in g if m.startswith("f1_kv@")]
    if not points:
        return []
    noise = "same_answer_noise" in g
    lines = ["", "KV mode at each fidelity point, overall (same questions, facts and text answers):", "",
             "| point | F1 | F1 retention | LL retention | top-1 agree | KL(text‖kv) | same answer |"
             + (" same answer / noise |" if noise else ""), "|" + "---|" * (7 + noise)]
    for name, s in (("kv (as configured)", ""), *((p, f"@{p}") for p in points)):
        lines.append(f"| {name} | {_ci(g['f1_kv' + s])} | {_ci(g['f1_retention_kv' + s])} | "
                     f"{_ci(g['ll_retention_kv' + s])} | {_ci(g['top1_agree' + s])} | {_ci(g['kl_text_kv' + s])} | "
                     f"{_ci(g['same_answer' + s])} |" + (f" {_ci(g['same_answer_rel' + s])} |" if noise else ""))
    return lines


def _noise_lines(summary: dict) -> list[str]:
    kv_modes = [k.removeprefix("same_answer_rel") for k in summary["overall"] if k.startswith("same_answer_rel")]
    lines = ["", "The engine's noise floor: text mode against its own second pass (prefix cache reset, other "
             "concurrency, reverse order), and KV mode's same-answer rate relative to it:", "",
             "| group | text vs text: same answer | top-1 agree | KL | F1 text2 - text | "
             + " | ".join(f"kv{s} same answer / noise" for s in kv_modes) + " |", "|" + "---|" * (5 + len(kv_modes))]
    lines += [f"| {name} | {_ci(g['same_answer_noise'])} | {_ci(g['top1_agree_noise'])} | {_ci(g['kl_noise'])} | "
              f"{_ci(g['f1_diff_noise'])} | " + " | ".join(_ci(g[f'same_answer_rel{s}']) for s in kv_modes) + " |"
              for name, g in summary.items()]
    return lines


def write(rows: list[dict], cfg, out: Path) -> str:
    """Summarise rows into out/<name>.json and out/<name>.md; returns the markdown table."""
    summary = summarize(rows)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{cfg.name}.json").write_text(json.dumps({"config": {**cfg.__dict__, "data": str(cfg.data), "window": cfg.window_size},
                                                       "summary": summary}, indent=2))
    table = markdown(summary, cfg.name)
    (out / f"{cfg.name}.md").write_text(table + "\n")
    return table
