"""`kvmem bench routing`: rendezvous against residency routing on the real topology (issue 54).

Real processes on loopback: PostgreSQL, Redis, two `kvmem replica`s and three gateways on the
same database and replicas: one in front of replica 1 alone (the warm-up), one routing by
rendezvous, one by residency (`--routing residency`).

The trace is a warm one after a membership change: every user's facts are written and asked
about once through the replica-1 gateway, so their KV sits in replica 1's RAM tier (and prefix
cache) while replica 2 has none, as when replica 2 has just joined. Then the users, split in two
halves with the same kind of facts, ask their questions through the two routing gateways in
turn (request i goes to arm i % 2), one request at a time, so both arms see the same host state
side by side. Rendezvous sends about half its users to replica 2, which pulls their blobs from
Redis and prefills their system prompt afresh; residency keeps them where their KV is. Then each
arm again with all its users at once (closed loop), one arm after the other.

Reported per arm: TTFT p50/p95 at the client (streamed, first content chunk), and the requests
each replica answered for it (the gateway's kvmem_replica_requests_total).
"""

from __future__ import annotations

import random
import re
import time
import uuid
from contextlib import ExitStack
from pathlib import Path

import httpx
from tqdm import tqdm

from kvmem.bench import locomo
from kvmem.bench.gateway import ask, concurrent, database, start
from kvmem.bench.report import percentile, write_json
from kvmem.bench.servers import postgres, redis

ARMS = ("rendezvous", "residency")


def run(*, data, workdir: Path, models_home: Path, users: int = 12, facts_per_user: int = 8, k: int = 5,
        rounds: int = 4, max_tokens: int = 16, seed: int = 0) -> dict:
    convs = locomo.load(data)
    texts = [o.text for c in convs for o in locomo.observations(c)]
    questions = [q["question"] for c in convs for q in locomo.questions(c)]
    rng = random.Random(seed)
    tag = uuid.uuid4().hex[:6]
    arms = {arm: [f"bench-rt-{tag}-{arm}-{u}" for u in range(users // 2)] for arm in ARMS}
    with ExitStack() as stack:
        db = database(stack.enter_context(postgres(workdir / "pg")), "routing")
        stores = {"KVMEM_KV_SHARED_URL": stack.enter_context(redis(workdir / "redis"))}
        replicas = [start(stack, f"replica-{i}", workdir, ["replica"], stores, models_home) for i in (1, 2)]
        gateway = {name: start(stack, f"gateway-{name}", workdir, ["gateway", "--replicas", ",".join(
            r.url for r in behind), "--database-url", db, *extra], stores, models_home)
            for name, behind, extra in (("replica-1", replicas[:1], []), ("rendezvous", replicas, []),
                                        ("residency", replicas, ["--routing", "residency"]))}
        with httpx.Client(base_url=gateway["replica-1"].url, timeout=600) as c:
            for user in tqdm([u for a in ARMS for u in arms[a]], desc="warm-up on replica 1", unit="user"):
                c.post("/v1/memories", json={"user_id": user, "facts": rng.sample(texts, facts_per_user),
                                             "encode": "sync"}).raise_for_status()
                ask(c, user, rng.choice(questions), k, max_tokens)
        time.sleep(3)  # the routing gateways' indexes hear the writes; the summaries are published
        sequential = _sequential(gateway, arms, questions, k, max_tokens, rounds, seed)
        together = {arm: concurrent(gateway[arm], arms[arm], questions, k, max_tokens, rounds, seed)
                    for arm in ARMS}
        placed = {arm: _per_replica(gateway[arm], [r.url for r in replicas]) for arm in ARMS}
    return {"bench": "routing", "users": users, "facts_per_user": facts_per_user, "k": k, "rounds": rounds,
            "max_tokens": max_tokens, "seed": seed, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "sequential": sequential, "concurrent": together, "per_replica": placed}


def _sequential(gateway, arms, questions, k, max_tokens, rounds, seed) -> dict:
    rng = random.Random(seed + 1)
    ttfts: dict[str, list[float]] = {arm: [] for arm in ARMS}
    clients = {arm: httpx.Client(base_url=gateway[arm].url, timeout=600) for arm in ARMS}
    try:
        for _ in tqdm(range(rounds), desc="sequential, arms in turn", unit="round"):
            for pair in zip(*(arms[arm] for arm in ARMS)):
                question = rng.choice(questions)  # the same question for both arms' users
                for arm, user in zip(ARMS, pair):
                    ttfts[arm].append(ask(clients[arm], user, question, k, max_tokens)[0])
    finally:
        for c in clients.values():
            c.close()
    return {arm: _summary(t) for arm, t in ttfts.items()}


def _summary(ttfts: list[float]) -> dict:
    return {"requests": len(ttfts), "ttft_p50": percentile(ttfts, 50), "ttft_p95": percentile(ttfts, 95),
            "ttfts": ttfts}


def _per_replica(gateway, urls: list[str]) -> dict[str, float]:
    """Requests each replica answered for this gateway (its kvmem_replica_requests_total)."""
    counts = dict.fromkeys(urls, 0.0)
    for line in httpx.get(gateway.url + "/metrics", timeout=30).text.splitlines():
        m = re.match(r'kvmem_replica_requests_total\{.*replica="([^"]+)".*\} (\S+)', line)
        if m and m.group(1) in counts:
            counts[m.group(1)] += float(m.group(2))
    return counts


def report(result: dict, out: Path) -> str:
    write_json(result, out.with_suffix(".json"))
    lines = [f"{result['users']} users ({result['users'] // 2} per arm) x {result['rounds']} questions, "
             f"k={result['k']}, {result['max_tokens']} new tokens, KV mode, streamed; TTFT at the client. "
             "Every user's KV warm on replica 1 only.", "",
             "| routing | sequential TTFT p50 ms | p95 ms | concurrent TTFT p50 ms | p95 ms | req/s | "
             "requests on replica 1 / 2 |", "|---|---|---|---|---|---|---|"]
    for arm in ARMS:
        s, c = result["sequential"][arm], result["concurrent"][arm]
        per = " / ".join(f"{n:.0f}" for n in result["per_replica"][arm].values())
        lines.append(f"| {arm} | {s['ttft_p50'] * 1e3:.0f} | {s['ttft_p95'] * 1e3:.0f} | {c['ttft_p50'] * 1e3:.0f} | "
                     f"{c['ttft_p95'] * 1e3:.0f} | {c['requests_per_s']:.2f} | {per} |")
    seq = result["sequential"]
    lines.append(f"\nsequential TTFT p50, residency / rendezvous: "
                 f"{seq['residency']['ttft_p50'] / seq['rendezvous']['ttft_p50']:.2f}")
    return "\n".join(lines)
