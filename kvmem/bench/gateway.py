"""`kvmem bench gateway`: `kvmem serve` beside a gateway in front of one and two replicas.

Every configuration runs as real processes on loopback (kvmem/bench/servers.py): `kvmem serve`
(vLLM in its own process, SQLite, a local KV folder) is the baseline; then PostgreSQL, Redis and
two `kvmem replica`s start, and one `kvmem gateway` is put in front of replica 1, then another in
front of replicas 1 and 2. Each configuration gets its own users with the same facts (LoCoMo
observations), encoded before timing. Then, over HTTP exactly as a client sees it:

- sequential: one request at a time, streamed, TTFT at the client (first content chunk); every
  configuration asks the same sequence (the same facts, the same questions), so the median of
  the paired differences against `kvmem serve` is the per-request cost of the gateway's hop;
- concurrent: U users at once in a closed loop, R questions each: requests/s and TTFT p50/p95.

The gateways' /metrics give the affinity hit rate (requests answered by the user's first-choice
replica) and the load per replica; vLLM's /metrics on each replica its prefix-cache hit rate.
On a 2-core host the two replicas share the same two cores, so a second replica adds no compute:
the numbers say what the hop and the routing cost, not how far a real cluster scales.
"""

from __future__ import annotations

import random
import re
import threading
import time
import uuid
from contextlib import ExitStack
from pathlib import Path

import httpx
from tqdm import tqdm

from kvmem.bench import locomo
from kvmem.bench.report import percentile, write_json
from kvmem.bench.servers import KvmemProcess, postgres, redis

# Two vLLMs share this host's memory (on CPU the utilization is a share of RAM); the reader
# adapter is off: LoRA on vLLM's CPU backend slows decode steps, and it is measured elsewhere.
ENV = {"KVMEM_READER_ADAPTER": "off", "KVMEM_GPU_MEMORY_UTILIZATION": "0.1"}


def run(*, data, workdir: Path, models_home: Path, users: int = 16, facts_per_user: int = 8, k: int = 5,
        rounds: int = 4, sequential: int = 8, max_tokens: int = 16, seed: int = 0) -> dict:
    convs = locomo.load(data)
    texts = [o.text for c in convs for o in locomo.observations(c)]
    questions = [q["question"] for c in convs for q in locomo.questions(c)]
    work = dict(texts=texts, questions=questions, users=users, facts_per_user=facts_per_user, k=k,
                rounds=rounds, sequential=sequential, max_tokens=max_tokens, seed=seed)
    rows = []
    with ExitStack() as stack:
        serve = start(stack, "serve", workdir, ["serve"], {}, models_home)
        rows.append(measure("serve", serve, [], **work))
        serve.stop()  # its engine must not share the cores with the replicas
        db_url, redis_url = stack.enter_context(postgres(workdir / "pg")), stack.enter_context(redis(workdir / "redis"))
        stores = {"KVMEM_KV_SHARED_URL": redis_url}
        replicas = [start(stack, f"replica-{i}", workdir, ["replica"], stores, models_home) for i in (1, 2)]
        for n, behind in (("gateway-1", replicas[:1]), ("gateway-2", replicas)):
            db = database(db_url, n.replace("-", "_"))
            gateway = start(stack, n, workdir, ["gateway", "--replicas", ",".join(r.url for r in behind),
                                                 "--database-url", db], stores, models_home)
            rows.append(measure(n, gateway, behind, **work))
            gateway.stop()
    # Every configuration asks the same sequence of (user's facts, question): paired differences.
    base = rows[0]["sequential"]["ttfts"]
    for row in rows:
        row["hop_ms"] = percentile([t - b for t, b in zip(row["sequential"]["ttfts"], base)], 50) * 1e3
    return {"bench": "gateway", "users": users, "facts_per_user": facts_per_user, "k": k, "rounds": rounds,
            "max_tokens": max_tokens, "seed": seed, "time": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": rows}


def start(stack: ExitStack, name: str, workdir: Path, args: list[str], env: dict, models_home: Path) -> KvmemProcess:
    home = workdir / name
    home.mkdir(parents=True, exist_ok=True)
    proc = KvmemProcess(name, home, args, {**ENV, **env}, models_home)
    stack.callback(proc.stop)
    return proc.wait("/v1/models" if args[0] == "replica" else "/health", timeout=900)


def database(url: str, name: str) -> str:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return url.rsplit("/", 1)[0] + "/" + name


def measure(name: str, server: KvmemProcess, replicas: list[KvmemProcess], *, texts, questions, users: int,
            facts_per_user: int, k: int, rounds: int, sequential: int, max_tokens: int, seed: int) -> dict:
    rng = random.Random(seed)
    ids = [f"bench-gw-{uuid.uuid4().hex[:6]}-{u}" for u in range(users)]
    with httpx.Client(base_url=server.url, timeout=600) as c:
        for user in tqdm(ids, desc=f"{name}: users' memories", unit="user"):
            r = c.post("/v1/memories", json={"user_id": user, "facts": rng.sample(texts, facts_per_user),
                                             "encode": "sync"})
            r.raise_for_status()
        for user in ids:  # warm-up: first requests of a process pay one-off costs
            ask(c, user, rng.choice(questions), k, max_tokens)
    before = [vllm_counters(r) for r in replicas]
    seq = _sequential(server, ids, questions, k, max_tokens, sequential, seed)
    conc = concurrent(server, ids, questions, k, max_tokens, rounds, seed)
    after = [vllm_counters(r) for r in replicas]
    row = {"config": name, "sequential": seq, "concurrent": conc, "replicas": len(replicas)}
    if replicas:
        row["affinity"] = _affinity(server)
        row["per_replica"] = [{"requests": a["requests"] - b["requests"],
                               "prefix_cache_hit_rate": _rate(a, b)} for a, b in zip(after, before)]
    return row


def ask(client: httpx.Client, user: str, question: str, k: int, max_tokens: int) -> tuple[float, int]:
    """One streamed KV-mode chat -> (TTFT at the client, chunks with content)."""
    start, first, chunks = time.perf_counter(), None, 0
    body = {"model": "kvmem", "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "stream": True, "memory": {"user_id": user, "k": k, "mode": "kv"}}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and '"content"' in line:
                first = first or time.perf_counter()
                chunks += 1
    return (first or time.perf_counter()) - start, chunks


def _sequential(server, ids, questions, k, max_tokens, n, seed) -> dict:
    rng = random.Random(seed + 1)
    with httpx.Client(base_url=server.url, timeout=600) as c:
        ttfts = [ask(c, rng.choice(ids), rng.choice(questions), k, max_tokens)[0] for _ in range(n)]
    return {"requests": n, "ttft_p50": percentile(ttfts, 50), "ttft_mean": sum(ttfts) / n, "ttfts": ttfts}


def concurrent(server, ids, questions, k, max_tokens, rounds, seed) -> dict:
    ttfts, chunks, errors, lock = [], [], [], threading.Lock()

    def user_loop(u: int) -> None:
        rng = random.Random(seed * 1000 + u)
        with httpx.Client(base_url=server.url, timeout=600) as c:
            for _ in range(rounds):
                try:
                    t, n = ask(c, ids[u], rng.choice(questions), k, max_tokens)
                    with lock:
                        ttfts.append(t)
                        chunks.append(n)
                except httpx.HTTPError as e:
                    errors.append(repr(e))

    start = time.perf_counter()
    threads = [threading.Thread(target=user_loop, args=(u,)) for u in range(len(ids))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    return {"users": len(ids), "requests": len(ttfts), "errors": errors, "wall_s": wall,
            "requests_per_s": len(ttfts) / wall, "chunks_per_s": sum(chunks) / wall,
            "ttft_p50": percentile(ttfts, 50), "ttft_p95": percentile(ttfts, 95)}


def _metric_lines(url: str) -> list[str]:
    return httpx.get(url + "/metrics", timeout=30).text.splitlines()


def vllm_counters(replica: KvmemProcess) -> dict:
    """Finished requests and prefix-cache hits/queries (tokens) of one replica, as vLLM counts them."""
    totals = {"requests": 0.0, "hits": 0.0, "queries": 0.0}
    names = {"vllm:request_success_total": "requests", "vllm:prefix_cache_hits_total": "hits",
             "vllm:prefix_cache_queries_total": "queries"}
    for line in _metric_lines(replica.url):
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            totals[names[name]] += float(line.rsplit(" ", 1)[1])
    return totals


def _rate(after: dict, before: dict) -> float | None:
    queries = after["queries"] - before["queries"]
    return (after["hits"] - before["hits"]) / queries if queries else None


def _affinity(gateway: KvmemProcess) -> dict:
    """Requests the gateway's replicas answered, by whether it was the user's first choice."""
    counts = {"first": 0.0, "other": 0.0}
    for line in _metric_lines(gateway.url):
        m = re.match(r'kvmem_replica_requests_total\{.*affinity="(first|other)".*\} (\S+)', line)
        if m:
            counts[m.group(1)] += float(m.group(2))
    total = counts["first"] + counts["other"]
    return {**counts, "hit_rate": counts["first"] / total if total else None}


def report(result: dict, out: Path) -> str:
    write_json(result, out.with_suffix(".json"))
    lines = [f"{result['users']} concurrent users x {result['rounds']} questions, k={result['k']}, "
             f"{result['max_tokens']} new tokens, KV mode, streamed; TTFT at the client.", "",
             "| config | seq. TTFT p50 ms | hop ms vs serve (paired median) | req/s | TTFT p50 ms | TTFT p95 ms | errors | "
             "affinity | prefix-cache hit rate per replica |", "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        s, c = r["sequential"], r["concurrent"]
        aff = r.get("affinity", {}).get("hit_rate")
        per = ", ".join(f"{p['requests']:.0f} req / {p['prefix_cache_hit_rate']:.2f}"
                        if p["prefix_cache_hit_rate"] is not None else f"{p['requests']:.0f} req"
                        for p in r.get("per_replica", []))
        lines.append(f"| {r['config']} | {s['ttft_p50'] * 1e3:.0f} | {r['hop_ms']:+.0f} | {c['requests_per_s']:.2f} | "
                     f"{c['ttft_p50'] * 1e3:.0f} | {c['ttft_p95'] * 1e3:.0f} | {len(c['errors'])} | "
                     f"{'-' if aff is None else f'{aff:.2f}'} | {per or '-'} |")
    return "\n".join(lines)
