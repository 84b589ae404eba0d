"""`kvmem bench load`: throughput and TTFT with many concurrent users, KV injection vs text prefill.

Each simulated user has their own memory (observations of the synthetic tuning set kvmem ships, or
of LoCoMo with --data) and runs a closed loop: ask,
wait for the answer, ask again, each time with k of their facts in a new random order. All
users of one level run at once (threads; the engine batches them). Text and KV mode run the
same workload one after the other.

With `fact_zipf` > 0 a user's k facts are drawn from a larger pool by Zipf popularity (a few
facts in most chats, as a memory's hot facts are), so the engine's RAM tier of decoded blobs
serves some of them and misses others: its hit rate over each KV level is reported beside it.
"""

from __future__ import annotations

import random
import statistics
import threading
import time

from tqdm import tqdm

from kvmem.bench import locomo
from kvmem.bench.report import percentile, plot_lines, write_json
from kvmem.connector.profile import work_total

DEFAULT_USERS = (1, 4, 16, 32, 64)


def setup(mem, data, users: int, pool: int, seed: int) -> tuple[dict[str, list[str]], list[str]]:
    convs = locomo.load(data)
    texts = list(dict.fromkeys(o.text for c in convs for o in locomo.observations(c)))  # distinct facts
    questions = [q["question"] for c in convs for q in locomo.questions(c)]
    rng = random.Random(seed)
    facts = {}
    for u in tqdm(range(users), desc="bench load: users' memories", unit="user"):
        user = f"bench-load-{u}"
        mem.delete_all(user_id=user)
        facts[user] = list(mem.add(facts=rng.sample(texts, pool), user_id=user).ids)
    return facts, questions


def pick(rng: random.Random, ids: list[str], k: int, zipf: float) -> list[str]:
    """k of `ids` in a random order: uniformly, or (zipf > 0) weighted by rank ** -zipf without
    replacement (Efraimidis-Spirakis keys), so the first ids of a user's pool are their hot facts."""
    if zipf <= 0:
        return rng.sample(ids, k)
    keys = [rng.random() ** ((rank + 1) ** zipf) for rank in range(len(ids))]  # u ** (1 / weight)
    chosen = [ids[i] for i in sorted(range(len(ids)), key=keys.__getitem__, reverse=True)[:k]]
    rng.shuffle(chosen)
    return chosen


def run_level(mem, facts: dict[str, list[str]], questions, users: int, mode: str, k: int, requests: int,
              max_tokens: int, seed: int, zipf: float = 0.0) -> dict:
    ttfts, out_tokens, errors, stages = [], [], [], []
    lock = threading.Lock()
    tiers = mem.kv_tiers()

    def user_loop(u: int) -> None:
        # Per seed, level and user: a level must not replay the chats of the warm-up or of a lower
        # level (same facts, same order, same question), which vLLM's prefix cache would serve whole.
        rng = random.Random(f"{seed}:{users}:{u}")
        ids = facts[f"bench-load-{u}"]
        for _ in range(requests):
            try:
                r = mem.chat(rng.choice(questions), user_id=f"bench-load-{u}", fact_ids=pick(rng, ids, k, zipf),
                             mode=mode, max_tokens=max_tokens, logprobs=None)
                with lock:
                    ttfts.append(r.ttft_s)
                    out_tokens.append(len(r.token_ids))
                    if "staging" in r.connector_ms:  # the worker's stages reached the report
                        stages.append(r.connector_ms)
            except Exception as e:  # noqa: BLE001 - counted and reported
                errors.append(repr(e))

    start = time.perf_counter()
    threads = [threading.Thread(target=user_loop, args=(u,)) for u in range(users)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    after = mem.kv_tiers()  # the engine's RAM tier, as its last report counted (a step may lag)
    hits, misses = (after[n] - tiers[n] for n in ("ram_hits", "ram_misses"))
    return {"users": users, "mode": mode, "requests": len(ttfts), "errors": errors, "wall_s": wall,
            "requests_per_s": len(ttfts) / wall, "output_tokens_per_s": sum(out_tokens) / wall,
            "ttft_p50": percentile(ttfts, 50), "ttft_p99": percentile(ttfts, 99),
            "ram_hit_rate": hits / (hits + misses) if hits + misses else None, **_stage_medians(stages)}


def _stage_medians(reports: list[dict[str, float]]) -> dict:
    """KV chats' connector stage timings (connector/profile.py) -> their medians per stage, the
    connector's total, and how many requests shared a step (its work is charged whole to each)."""
    if not reports:
        return {}
    names = sorted({n for r in reports for n in r if n != "shared_step"})
    return {"connector_ms": {n: statistics.median(r.get(n, 0.0) for r in reports) for n in names},
            "connector_total_ms": statistics.median(work_total(r) for r in reports),
            "shared_step_median": statistics.median(r.get("shared_step", 1) for r in reports),
            "connector_reports": len(reports)}


def run(mem, *, data=None, levels=DEFAULT_USERS, k: int = 50, requests: int = 4, max_tokens: int = 16,
        seed: int = 0, fact_zipf: float = 0.0, pool: int | None = None) -> dict:
    """`data`: a LoCoMo(-shaped) file; None reads the synthetic tuning set kvmem ships.
    fact_zipf: > 0 draws each chat's k facts by Zipf popularity from a pool of `pool` facts per
    user (default: k + 20 uniform, 4k with Zipf)."""
    path, which = locomo.bench_data(data)
    pool = pool or (4 * k if fact_zipf > 0 else k + 20)
    facts, questions = setup(mem, path, max(levels), pool=pool, seed=seed)
    for mode in ("text", "kv"):  # warm-up, on draws of its own (seed - 1)
        run_level(mem, facts, questions, 1, mode, k, 1, max_tokens, seed - 1, fact_zipf)
    rows = []
    for users in tqdm(levels, desc="bench load", unit="level"):
        per_mode = {mode: run_level(mem, facts, questions, users, mode, k, requests, max_tokens, seed, fact_zipf)
                    for mode in ("text", "kv")}
        rows.append({"users": users, **per_mode,
                     "throughput_ratio": per_mode["kv"]["requests_per_s"] / per_mode["text"]["requests_per_s"],
                     "ttft_p50_ratio": per_mode["text"]["ttft_p50"] / per_mode["kv"]["ttft_p50"]})
    return {"bench": "load", "data": which, "data_path": str(path), "k": k, "requests_per_user": requests,
            "max_tokens": max_tokens, "seed": seed, "fact_zipf": fact_zipf, "pool": pool,
            "time": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": rows}


def _stages_line(users: int, kv: dict) -> str:
    ms = kv["connector_ms"]
    main = ", ".join(f"{n} {ms[n]:.1f}" for n in ("blob_reads", "staging", "placement", "scatter", "forward") if n in ms)
    return (f"- {users} users, KV: the connector's work per request {kv['connector_total_ms']:.1f} ms ({main}; "
            f"medians over {kv['connector_reports']} chats; a step's work is charged whole to each of its "
            f"requests, {kv['shared_step_median']:g} a step at the median)")


def report(result: dict, out) -> str:
    write_json(result, out.with_suffix(".json"))
    users = [r["users"] for r in result["rows"]]
    plot_lines(out.with_suffix(".png"), users, {m: [r[m]["requests_per_s"] for r in result["rows"]] for m in ("text", "kv")},
               "concurrent users", "requests / s", f"Throughput at k={result['k']}: text prefill vs KV injection")
    lines = [locomo.describe_data(result["data"], result["data_path"]), "",
             f"Facts per chat: k={result['k']} of a pool of {result.get('pool', '?')} per user, "
             + (f"by Zipf({result['fact_zipf']}) popularity" if result.get("fact_zipf") else "uniformly"), "",
             "| users | mode | req/s | out tok/s | TTFT p50 ms | TTFT p99 ms | RAM-tier hit rate | errors |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        for m in ("text", "kv"):
            x = r[m]
            rate = "-" if m == "text" or x.get("ram_hit_rate") is None else f"{x['ram_hit_rate']:.2f}"
            lines.append(f"| {r['users']} | {m} | {x['requests_per_s']:.2f} | {x['output_tokens_per_s']:.1f} | "
                         f"{x['ttft_p50'] * 1e3:.0f} | {x['ttft_p99'] * 1e3:.0f} | {rate} | {len(x['errors'])} |")
    lines.append("")
    lines += [f"- {r['users']} users: throughput kv/text = {r['throughput_ratio']:.2f}x, "
              f"TTFT p50 text/kv = {r['ttft_p50_ratio']:.2f}x" for r in result["rows"]]
    lines += [_stages_line(r["users"], r["kv"]) for r in result["rows"] if "connector_ms" in r["kv"]]
    return "\n".join(lines)
