"""`kvmem bench ttft`: time to first token vs the number of facts k, KV injection vs text prefill.

Both modes get the same k facts in the same (random) order per repetition, so the only
difference is how the facts reach the engine. Orders change every repetition, so text mode
cannot ride vLLM's prefix cache past the system prefix (prefix caching stays on, as in
production). Modes alternate which goes first. max_tokens=1: the latency is the TTFT.

Two engine floors follow text mode: "cached" repeats its prompt at once (every full block is a
prefix-cache hit, the question's too), "facts hit" asks another question after the same facts
(the hit covers the system prefix and the facts' full blocks, and the engine computes the rest,
as KV mode does). The second is the fair floor for KV reuse: a new question is never cached.
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path

from tqdm import tqdm

from kvmem.bench import locomo
from kvmem.bench.metrics import median_ratio_ci
from kvmem.bench.report import plot_lines, summary, write_json
from kvmem.connector.profile import NESTED, SCHEDULER_STAGES, STEP_STAGES, WORKER_STAGES, work_total
from kvmem.kv import fidelity
from kvmem.kv.recompute import Recompute

USER = "bench-ttft"
DEFAULT_KS = (0, 5, 10, 25, 50, 100)


def run(mem, *, data: Path | None = None, ks=DEFAULT_KS, reps: int = 5, seed: int = 0, profile: bool = False,
        points: tuple[str, ...] = ()) -> dict:
    """`data`: a LoCoMo(-shaped) file; None reads the synthetic tuning set kvmem ships.
    profile: per k, also where KV mode's time goes (`profile_k`), after the timed repetitions.
    points: fidelity points (kv/fidelity.py `parse`) timed in the same repetitions, beside plain
    injection of every fact: each one's share of its TTFT gain, side by side in one run."""
    chosen_points = fidelity_points(points)
    path, which = locomo.bench_data(data)
    convs = locomo.load(path)
    # Distinct texts (the synthetic set repeats a few): a sample of k ids is k different facts.
    facts = list(dict.fromkeys(o.text for c in convs for o in locomo.observations(c)))[: max(max(ks) * 2, 50)]
    questions = [q["question"] for c in convs[:1] for q in locomo.questions(c)]
    mem.delete_all(user_id=USER)
    added = mem.add(facts=facts, user_id=USER)
    ids = list(added.ids)
    rng = random.Random(seed)
    for mode in ("text", "kv"):  # warm-up, not timed
        mem.chat(questions[0], user_id=USER, fact_ids=ids[:5], mode=mode, max_tokens=1)
    # With a reader adapter, "kv" reads with it and "kv_plain" is KV mode without it: its TTFT cost.
    others = ("kv_plain",) if mem.engine.reader_adapter else ()
    # With kv.text_facts or kv.recompute, "kv" prefills its last facts as text or recomputes some
    # fact tokens, and "kv_all" injects every fact plainly: their cost.
    others += ("kv_all",) if mem.config.kv.text_facts_setting or mem.config.kv.recompute_setting.on else ()
    others += tuple(chosen_points)
    reference = "kv_all" if "kv_all" in others else "kv"  # plain injection of every fact, this run
    rows = []
    for k in tqdm(ks, desc="bench ttft", unit="k"):
        times, served, tokens = _time_k(mem, ids, questions, k, reps, rng, others, chosen_points)
        row = _row(k, tokens, times, served, reference)
        if profile:
            row["profile"] = profile_k(mem, ids, questions, k, reps, rng)
        rows.append(row)
    k0 = next((r for r in rows if r["k"] == 0), None)
    growth = {m: rows[-1][m]["median"] / k0[m]["median"] for m in ("kv", "cached")} if k0 else {}
    return {"bench": "ttft", "data": which, "data_path": str(path), "reader_adapter": str(mem.engine.reader_adapter or ""),
            "text_facts": mem.config.kv.text_facts_setting,
            "recompute": mem.config.kv.recompute_setting.tag, "facts_pool": len(ids), "reps": reps, "seed": seed, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "encode_seconds": added.encode.seconds if added.encode else None, "rows": rows,
            "kv_growth_max_k_over_k0": growth.get("kv"), "cached_growth_max_k_over_k0": growth.get("cached")}


def _time_k(mem, ids: list[str], questions: list[str], k: int, reps: int, rng: random.Random,
            others: tuple[str, ...], points: dict) -> tuple[dict, dict, int]:
    """`reps` repetitions at k, each mode once per repetition on the same facts (the order of
    the modes alternating) -> seconds per mode, what each point's last chat did, prompt tokens."""
    times = {m: [] for m in ("text", "kv", *others, "cached", "facts_hit")}
    served = {}  # per point: the last chat's injected and recomputed tokens (what the point did)
    plain, tokens = Recompute(0.0), 0
    for rep in range(reps):
        chosen = rng.sample(ids, k)
        at = rng.randrange(len(questions))
        first = ("text", "kv", *others) if rep % 2 == 0 else (*others[::-1], "kv", "text")
        for mode in (*first, "cached", "facts_hit"):
            q = questions[(at + (mode == "facts_hit")) % len(questions)]
            point = points.get(mode)
            r = mem.chat(q, user_id=USER, fact_ids=chosen, mode="text" if mode in ("text", "cached", "facts_hit")
                         else "kv", max_tokens=1, logprobs=None, reader=mode != "kv_plain",
                         text_facts=0 if mode == "kv_all" else point.text_facts if point else None,
                         recompute=plain if mode == "kv_all" else point.recompute if point else None)
            times[mode].append(r.ttft_s)
            if point:
                served[mode] = {"injected_tokens": r.injected_tokens, "recomputed_tokens": r.recomputed_tokens}
            tokens = r.prompt_tokens
    return times, served, tokens


def _row(k: int, tokens: int, times: dict, served: dict, reference: str) -> dict:
    """One k's medians and ratios; `served` names the points ("at:<name>") timed beside `reference`."""
    stats = {m: summary(t) for m, t in times.items()}
    text, kv, cached, hit = (stats[m] for m in ("text", "kv", "cached", "facts_hit"))
    row = {"k": k, "prompt_tokens": tokens, **stats, "ratio_median": text["median"] / kv["median"],
           "kv_over_cached": kv["median"] / cached["median"],
           "kv_over_facts_hit": kv["median"] / hit["median"], "raw": times}
    if "kv_plain" in stats:  # text/kv with the adapter as a share of text/kv without it (target >= 0.9)
        row["ratio_median_plain"] = text["median"] / stats["kv_plain"]["median"]
        row["adapter_ratio_share"] = row["ratio_median"] / row["ratio_median_plain"]
    if "kv_all" in stats:  # text/kv with the last facts as text, as a share of text/kv injecting all
        row["ratio_median_all"] = text["median"] / stats["kv_all"]["median"]
        row["text_facts_ratio_share"] = row["ratio_median"] / row["ratio_median_all"]
    if served:  # each point's text/kv as a share of plain injection's, same repetitions
        row["points"] = {mode[3:]: {**stats[mode], **done, "ratio": text["median"] / stats[mode]["median"],
                                    "share": stats[reference]["median"] / stats[mode]["median"]}
                         for mode, done in served.items()}
        row["points_reference"] = reference
    return row


def profile_k(mem, ids: list[str], questions: list[str], k: int, reps: int, rng: random.Random) -> dict:
    """Medians over `reps` KV-mode chats of k random facts: the connector's milliseconds by stage
    (connector/profile.py; two tokens asked, so the worker's timings reach the report), and
    what the client spends before the engine: retrieval of k facts and the prompt's assembly."""
    stages: dict[str, list[float]] = {}
    client: dict[str, list[float]] = {"retrieval": [], "assembly": []}
    for _ in range(reps):
        q = questions[rng.randrange(len(questions))]
        r = mem.chat(q, user_id=USER, fact_ids=rng.sample(ids, k), mode="kv", max_tokens=2, logprobs=None)
        for name in (*SCHEDULER_STAGES, *WORKER_STAGES, *STEP_STAGES):
            stages.setdefault(name, []).append(r.connector_ms.get(name, 0.0))
        if k:  # retrieval as a chat does it (text mode: only the client side is read here)
            searched = mem.chat(q, user_id=USER, k=k, mode="text", max_tokens=1, logprobs=None)
            client["retrieval"].append(searched.retrieval_s * 1e3)
            client["assembly"].append(searched.assembly_s * 1e3)
    return {"connector_ms": {n: statistics.median(v) for n, v in stages.items()},
            "client_ms": {n: statistics.median(v) for n, v in client.items() if v}}


_LABELS = {"text": "text prefill", "kv": "KV injection", "cached": "prefix-cache hit, same prompt",
           "facts_hit": "prefix-cache hit of the facts, new question (engine floor)"}


def fidelity_points(names: tuple[str, ...]) -> dict:
    """Mode name -> Fidelity of each point. Every timed mode must have a cache salt of its own, or
    one would be served another's blocks from the prefix cache in the same repetition: so no
    point may be plain injection (timed already as kv) or repeat another."""
    chosen: dict = {}
    for name in names:
        point = fidelity.parse(name)
        if not point.text_facts and not point.recompute.on:
            raise ValueError(f"point {name!r} is plain injection, which bench ttft times anyway")
        if point in chosen.values():
            raise ValueError(f"point {name!r} repeats another point of --points")
        chosen[f"at:{name}"] = point
    return chosen


def add_intervals(result: dict) -> dict:
    """Bootstrap 95% intervals from the raw times: text/kv per k (paired by repetition) and growth."""
    rows = result["rows"]
    for r in rows:
        r["ratio_ci"] = median_ratio_ci(r["raw"]["text"], r["raw"]["kv"], paired=True)
    k0 = next((r for r in rows if r["k"] == 0), None)
    if k0 is not None:
        for mode in ("kv", "cached"):
            result[f"{mode}_growth_ci"] = median_ratio_ci(rows[-1]["raw"][mode], k0["raw"][mode], paired=False)
    return result


def report(result: dict, out: Path) -> str:
    add_intervals(result)
    write_json(result, out.with_suffix(".json"))
    ks = [r["k"] for r in result["rows"]]
    plot_lines(out.with_suffix(".png"), ks,
               {label: [r[m]["median"] * 1000 for r in result["rows"]] for m, label in _LABELS.items()},
               "facts injected (k)", "median TTFT (ms)", "TTFT vs k: text prefill, KV injection, prefix-cache hit")
    lines = [locomo.describe_data(result["data"], result["data_path"]), "",
             "| k | prompt tokens | text median (p90) ms | kv median (p90) ms | prefix-cache hit median (p90) ms "
             "| facts hit, new question, median (p90) ms | text/kv [95% CI] | kv/hit | kv/facts hit |",
             "|---|---|---|---|---|---|---|---|---|"]
    ms = lambda s: f"{s['median'] * 1e3:.1f} ({s['p90'] * 1e3:.1f})"  # noqa: E731
    for r in result["rows"]:
        hit = f"{ms(r['facts_hit'])} | " if "facts_hit" in r else "- | "
        ratio = f" {r['kv_over_facts_hit']:.2f}x |" if "facts_hit" in r else " - |"
        lines.append(f"| {r['k']} | {r['prompt_tokens']} | {ms(r['text'])} | {ms(r['kv'])} | {ms(r['cached'])} "
                     f"| {hit}{r['ratio_median']:.2f}x [{r['ratio_ci'][1]:.2f}, {r['ratio_ci'][2]:.2f}] "
                     f"| {r['kv_over_cached']:.2f}x |{ratio}")
    if "kv_growth_ci" in result:
        kv, hit = result["kv_growth_ci"], result["cached_growth_ci"]
        lines.append(f"\nKV-mode TTFT(k={ks[-1]}) / TTFT(k=0) = {kv[0]:.2f} [{kv[1]:.2f}, {kv[2]:.2f}]; "
                     f"the engine's own prefix-cache hit grows {hit[0]:.2f}x [{hit[1]:.2f}, {hit[2]:.2f}] over the same range")
    if any("profile" in r for r in result["rows"]):
        lines += ["", *profile_table(result["rows"])]
    if any("kv_plain" in r for r in result["rows"]):
        lines.append(f"\nReader adapter {result['reader_adapter']}: kv above reads with it; without it, same run:\n\n"
                     "| k | kv without adapter median (p90) ms | text/kv without | text/kv with / without |\n|---|---|---|---|")
        lines += [f"| {r['k']} | {ms(r['kv_plain'])} | {r['ratio_median_plain']:.2f}x | {r['adapter_ratio_share']:.2f} |"
                  for r in result["rows"]]
    if any("points" in r for r in result["rows"]):
        lines += ["", *points_table(result["rows"])]
    elif any("kv_all" in r for r in result["rows"]):
        what = (f"prefills its last {result['text_facts']} facts as text (kv.text_facts)" if result.get("text_facts")
                else f"recomputes fact tokens ({result.get('recompute')}, kv.recompute)")
        lines.append(f"\nkv above {what}; injecting every fact plainly instead, same run:\n\n"
                     "| k | kv, all injected, median (p90) ms | text/kv all injected | text/kv with / without |\n|---|---|---|---|")
        lines += [f"| {r['k']} | {ms(r['kv_all'])} | {r['ratio_median_all']:.2f}x | {r['text_facts_ratio_share']:.2f} |"
                  for r in result["rows"]]
    return "\n".join(lines)


def points_table(rows: list[dict]) -> list[str]:
    """Each fidelity point's TTFT beside plain injection of every fact, timed in the same repetitions."""
    lines = ["Fidelity points (`--points`), timed in the same repetitions as plain injection of every fact:", "",
             "| k | point | median (p90) ms | text/kv | share of plain injection's text/kv kept |", "|---|---|---|---|---|"]
    for r in rows:
        plain = r[r["points_reference"]]
        lines.append(f"| {r['k']} | plain injection | {plain['median'] * 1e3:.1f} ({plain['p90'] * 1e3:.1f}) | "
                     f"{r['text']['median'] / plain['median']:.2f}x | 1 |")
        lines += [f"| {r['k']} | {name} | {p['median'] * 1e3:.1f} ({p['p90'] * 1e3:.1f}) | {p['ratio']:.2f}x | "
                  f"{p['share']:.2f} |" for name, p in r["points"].items()]
    return lines


def profile_table(rows: list[dict]) -> list[str]:
    """Where KV mode's time over the engine's floor (facts hit) goes, per k: the connector's
    stages in the engine's processes (a nested stage shown, counted once), the rest
    unattributed; beside them the injecting step's handoff and forward, which the floor has
    too (connector/profile.py), and the client's side before the engine."""
    stages = (*SCHEDULER_STAGES, *WORKER_STAGES)
    heads = [f"{n} (in {NESTED[n]})" if n in NESTED else n for n in stages]
    lines = ["Where KV mode's time goes (`--profile`; medians, ms; scheduler: " + ", ".join(SCHEDULER_STAGES)
             + "; worker: " + ", ".join(WORKER_STAGES) + "; the step around the load: "
             + ", ".join(STEP_STAGES) + "):", "",
             "| k | kv - facts hit | " + " | ".join(heads) + " | connector total | unattributed | "
             + " | ".join(STEP_STAGES) + " | client: retrieval | client: assembly |",
             "|---" * (len(stages) + len(STEP_STAGES) + 6) + "|"]
    for r in rows:
        if "profile" not in r:
            continue
        ms, client = r["profile"]["connector_ms"], r["profile"]["client_ms"]
        over = (r["kv"]["median"] - r["facts_hit"]["median"]) * 1e3
        total = work_total(ms)
        cells = [f"{ms.get(n, 0.0):.2f}" for n in (*stages, *STEP_STAGES)]
        lines.append(f"| {r['k']} | {over:.1f} | " + " | ".join(cells[:len(stages)]) + f" | {total:.1f} | "
                     f"{over - total:.1f} | " + " | ".join(cells[len(stages):])
                     + f" | {client.get('retrieval', 0.0):.1f} | {client.get('assembly', 0.0):.1f} |")
    return lines
