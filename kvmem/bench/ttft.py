"""`kvmem bench ttft`: time to first token vs the number of facts k, KV injection vs text prefill.

Both modes get the same k facts in the same (random) order per repetition, so the only
difference is how the facts reach the engine. Orders change every repetition, so text mode
cannot ride vLLM's prefix cache past the system prefix (prefix caching stays on, as in
production). Modes alternate which goes first. max_tokens=1: the latency is the TTFT.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

from tqdm import tqdm

from kvmem.bench import locomo
from kvmem.bench.report import plot_lines, summary, write_json

USER = "bench-ttft"
DEFAULT_KS = (0, 5, 10, 25, 50, 100)


def run(mem, *, data: Path, ks=DEFAULT_KS, reps: int = 5, seed: int = 0) -> dict:
    convs = locomo.load(data)
    facts = [o.text for c in convs for o in locomo.observations(c)][: max(max(ks) * 2, 50)]
    questions = [q["question"] for c in convs[:1] for q in locomo.questions(c)]
    mem.delete_all(user_id=USER)
    added = mem.add(facts=facts, user_id=USER)
    ids = list(added.ids)
    rng = random.Random(seed)
    for mode in ("text", "kv"):  # warm-up, not timed
        mem.chat(questions[0], user_id=USER, fact_ids=ids[:5], mode=mode, max_tokens=1)
    rows = []
    for k in tqdm(ks, desc="bench ttft", unit="k"):
        times = {"text": [], "kv": []}
        tokens = 0
        for rep in range(reps):
            chosen = rng.sample(ids, k)
            q = questions[rng.randrange(len(questions))]
            for mode in (("text", "kv") if rep % 2 == 0 else ("kv", "text")):
                r = mem.chat(q, user_id=USER, fact_ids=chosen, mode=mode, max_tokens=1, logprobs=None)
                times[mode].append(r.ttft_s)
                tokens = r.prompt_tokens
        text, kv = summary(times["text"]), summary(times["kv"])
        rows.append({"k": k, "prompt_tokens": tokens, "text": text, "kv": kv, "ratio_median": text["median"] / kv["median"],
                     "raw": times})
    k0 = next((r for r in rows if r["k"] == 0), None)
    return {"bench": "ttft", "facts_pool": len(ids), "reps": reps, "seed": seed, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "encode_seconds": added.encode.seconds if added.encode else None, "rows": rows,
            "kv_growth_max_k_over_k0": (rows[-1]["kv"]["median"] / k0["kv"]["median"]) if k0 else None}


def report(result: dict, out: Path) -> str:
    write_json(result, out.with_suffix(".json"))
    ks = [r["k"] for r in result["rows"]]
    plot_lines(out.with_suffix(".png"), ks, {m: [r[m]["median"] * 1000 for r in result["rows"]] for m in ("text", "kv")},
               "facts injected (k)", "median TTFT (ms)", "TTFT vs k: text prefill vs KV injection")
    lines = ["| k | prompt tokens | text median (p90) ms | kv median (p90) ms | text/kv |", "|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['k']} | {r['prompt_tokens']} | {r['text']['median'] * 1e3:.1f} ({r['text']['p90'] * 1e3:.1f}) "
                     f"| {r['kv']['median'] * 1e3:.1f} ({r['kv']['p90'] * 1e3:.1f}) | {r['ratio_median']:.2f}x |")
    if result["kv_growth_max_k_over_k0"]:
        lines.append(f"\nKV-mode TTFT(k={ks[-1]}) / TTFT(k=0) = {result['kv_growth_max_k_over_k0']:.2f}")
    return "\n".join(lines)
