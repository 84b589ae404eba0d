"""`kvmem bench cache`: TTFT and disk-tier hit rate under a byte budget, with a skewed workload.

Many users, each with their own facts (LoCoMo observations, dealt out in turn). Every request
picks a user by Zipf(s) over users and k of that user's facts by Zipf(s) over the user's facts,
then asks a LoCoMo question in KV mode (max_tokens=1, so the latency is the TTFT). The same
request stream is replayed under each disk budget, given as a share of the working set (the
bytes of every fact's blob); the unlimited run comes first and is the reference. A text-mode
pass over the same stream gives the ceiling that eviction falls back to.

Each budget run reopens the service on the same engine with that budget (evicting at start),
empties the engine's own prefix cache (else a run would ride the blocks of the run before, which
served the very same prompts), replays `warmup` requests untimed (so the policy has seen the
skew), then the timed ones. Within a run the engine's prefix cache works as in production. The
background encoder stays on: re-encodes of evicted facts that chats bring back compete with
the chats for the CPU, as they would in production.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

from tqdm import tqdm

from kvmem.bench import locomo
from kvmem.bench.report import percentile, plot_lines, write_json
from kvmem.chat import kv_first

USER = "bench-cache-{:03d}"


def zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (rank + 1) ** s for rank in range(n)]


def requests(n: int, users: int, facts_per_user: int, k: int, s: float, questions: int, seed: int) -> list[tuple]:
    """-> [(user index, fact indices within the user, question index)]: one replayable stream."""
    rng = random.Random(seed)
    user_w, fact_w = zipf_weights(users, s), zipf_weights(facts_per_user, s)
    stream = []
    for _ in range(n):
        user = rng.choices(range(users), user_w)[0]
        chosen: list[int] = []
        while len(chosen) < k:
            f = rng.choices(range(facts_per_user), fact_w)[0]
            if f not in chosen:
                chosen.append(f)
        stream.append((user, tuple(sorted(chosen)), rng.randrange(questions)))
    return stream


def _populate(mem, data: Path, users: int, facts_per_user: int) -> tuple[list[list[str]], list[str]]:
    convs = locomo.load(data)
    pool = [o.text for c in convs for o in locomo.observations(c)]
    need = users * facts_per_user
    if len(pool) < need:
        raise ValueError(f"{data} has {len(pool)} observations; {users} users x {facts_per_user} facts need {need}")
    questions = [q["question"] for c in convs for q in locomo.questions(c)]
    ids = []
    for u in tqdm(range(users), desc="adding users", unit="user"):
        mem.delete_all(user_id=USER.format(u))
        texts = pool[u * facts_per_user:(u + 1) * facts_per_user]
        ids.append(list(mem.add(facts=texts, user_id=USER.format(u)).ids))
    return ids, questions


def _replay(mem, stream, ids, questions, mode: str, desc: str) -> list[float]:
    """Each chat names its facts (the Zipf draw) in the order the service would put them."""
    times = []
    for user, facts, q in tqdm(stream, desc=desc, unit="chat", leave=False):
        records = [mem.get(ids[user][f]) for f in facts]
        chosen = kv_first(records) if mode == "kv" else records
        r = mem.chat(questions[q], user_id=USER.format(user), fact_ids=[f.id for f in chosen],
                     mode=mode, max_tokens=1, logprobs=None)
        times.append(r.ttft_s)
    return times


def run(open_mem, *, data: Path, users: int = 40, facts_per_user: int = 10, k: int = 5, s: float = 1.0,
        budgets=(None, 0.5, 0.2, 0.1), warmup: int = 100, timed: int = 200, seed: int = 0) -> dict:
    """open_mem(disk_budget_mib) -> a KVMem on the bench's engine and home with that budget."""
    mem = open_mem(None)
    ids, questions = _populate(mem, data, users, facts_per_user)
    working_set = sum(mem.kv.stamp(f)[1] for user in ids for f in user)
    stream = requests(warmup + timed, users, facts_per_user, k, s, len(questions), seed)
    mem.engine.reset_prefix_cache()
    text = _replay(mem, stream[warmup:], ids, questions, "text", "text mode")
    mem.close()
    rows = []
    for share in budgets:
        mib = None if share is None else share * working_set / (1 << 20)
        mem = open_mem(mib)
        mem.engine.reset_prefix_cache()  # each run starts without the last one's cached blocks
        _replay(mem, stream[:warmup], ids, questions, "kv", f"warm-up, budget {share or 'unlimited'}")
        before = mem.kv_tiers()
        times = _replay(mem, stream[warmup:], ids, questions, "kv", f"timed, budget {share or 'unlimited'}")
        after = mem.kv_tiers()
        mem.close()
        hits, misses = (after[n] - before[n] for n in ("disk_hits", "disk_misses"))
        rows.append({"budget_share": share, "budget_bytes": None if mib is None else int(mib * (1 << 20)),
                     "ttft_p50": percentile(times, 50), "ttft_p95": percentile(times, 95),
                     "hit_rate": hits / max(1, hits + misses), "evictions": after["evictions"] - before["evictions"],
                     "readmissions": after["readmissions"] - before["readmissions"], "ram_hit_rate":
                     _rate(after["ram_hits"] - before["ram_hits"], after["ram_misses"] - before["ram_misses"]),
                     "raw": times})
    base = rows[0]["ttft_p50"]
    for row in rows:
        row["p50_over_unlimited"] = row["ttft_p50"] / base
    return {"bench": "cache", "users": users, "facts_per_user": facts_per_user, "k": k, "zipf_s": s,
            "warmup": warmup, "timed": timed, "seed": seed, "working_set_bytes": working_set,
            "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "text": {"ttft_p50": percentile(text, 50), "ttft_p95": percentile(text, 95), "raw": text},
            "rows": rows}


def _rate(hits: int, misses: int) -> float | None:
    return hits / (hits + misses) if hits + misses else None


def report(result: dict, out: Path) -> str:
    write_json(result, out.with_suffix(".json"))
    rows = result["rows"]
    xs = [r["budget_share"] or 1.0 for r in rows]
    plot_lines(out.with_suffix(".png"), xs,
               {"KV mode p50": [r["ttft_p50"] * 1000 for r in rows], "KV mode p95": [r["ttft_p95"] * 1000 for r in rows],
                "text mode p50": [result["text"]["ttft_p50"] * 1000] * len(rows)},
               "disk budget (share of the working set; 1.0 = unlimited)", "TTFT (ms)",
               f"{result['users']} users, Zipf({result['zipf_s']}), k={result['k']}")
    lines = [f"working set {result['working_set_bytes'] / (1 << 20):.1f} MiB; text mode p50 "
             f"{result['text']['ttft_p50'] * 1000:.0f} ms, p95 {result['text']['ttft_p95'] * 1000:.0f} ms",
             "budget  p50 ms  p95 ms  p50/unlimited  disk hit rate  RAM hit rate  evictions  re-encodes (timed part)"]
    for r in rows:
        ram = "-" if r["ram_hit_rate"] is None else f"{r['ram_hit_rate']:.2f}"
        lines.append(f"{r['budget_share'] or 'none':>6}  {r['ttft_p50'] * 1000:6.0f}  {r['ttft_p95'] * 1000:6.0f}  "
                     f"{r['p50_over_unlimited']:13.2f}  {r['hit_rate']:13.2f}  {ram:>12}  {r['evictions']:9}  "
                     f"{r['readmissions']:10}")
    return "\n".join(lines)
