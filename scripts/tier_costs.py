"""What one fact's blob costs to reach from each tier, through the real KVStore (issue 54's simulator).

    .venv/bin/python scripts/tier_costs.py --out docs/results/tier-costs.json

Blobs the size of a LoCoMo observation for SmolLM2-135M (20 tokens x 30 layers x 3 KV heads x 64,
bf16 keys and values: ~0.46 MB, as `bench ttft` and `bench cache` store them) are put through one
store with a shared tier (a real Redis on loopback, as the topology test runs it), then fetched by:

- "ram": the same store again (its RAM tier, `KVStore.fetch` hit);
- "disk": a second store on the same folder with an empty RAM tier (the local file; the OS page
  cache is warm, as it is on a replica that wrote or read the blob recently);
- "pull": a third store on an empty folder: the blob comes from Redis (GET, write the local file,
  read it back, verify), which is what a replica pays for a fact it does not hold.

Each is timed per blob over `--blobs` blobs, interleaved across rounds after an untimed one;
medians and p90 in seconds. The pull's spread is wide on a shared host (its local write is
fsynced, as every blob write is): compare runs before trusting a median.
The simulator (kvmem/bench/cluster_sim.py) reads the medians from the JSON this writes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kvmem.bench import servers
from kvmem.kv.blob import KVBlob
from kvmem.kv.store import KVStore

FINGERPRINT = "0" * 64
SHAPE = (30, 20, 3, 64)  # [L, T, H, D] of one ~20-token observation on SmolLM2-135M


def blob(i: int) -> KVBlob:
    g = torch.Generator().manual_seed(i)
    keys, values = (torch.randn(SHAPE, generator=g).to(torch.bfloat16) for _ in range(2))
    return KVBlob(f"f{i}", FINGERPRINT, tuple(range(SHAPE[1])), keys, values)


def timed(store: KVStore, ids: list[str]) -> list[float]:
    out = []
    for fact_id in ids:
        t = time.perf_counter()
        store.fetch(fact_id)
        out.append(time.perf_counter() - t)
    return out


def measure(work: Path, n: int, rounds: int) -> dict:
    times: dict[str, list[float]] = {"ram": [], "disk": [], "pull": []}
    with servers.redis(work) as url:
        writer = KVStore(work / "a", FINGERPRINT, shared_url=url)
        for r in range(-1, rounds):  # round -1: untimed warm-up (connections, first calls)
            ids = [f"f{r}-{i}" for i in range(n)]
            for i, fact_id in enumerate(ids):
                b = blob((r + 1) * n + i)
                writer.put(KVBlob(fact_id, FINGERPRINT, b.token_ids, b.key, b.value))
            disk = KVStore(work / "a", FINGERPRINT, hot_cache_bytes=0, shared_url=url)
            pull = KVStore(work / f"b{r}", FINGERPRINT, shared_url=url)
            got = {"disk": timed(disk, ids), "pull": timed(pull, ids)}
            timed(writer, ids)  # into the writer's RAM tier
            got["ram"] = timed(writer, ids)
            if r >= 0:
                for tier, t in got.items():
                    times[tier] += t
            for store in (disk, pull):
                store.close()
        nbytes = blob(0).nbytes
        writer.close()
    summary = {tier: {"median": statistics.median(t), "mean": statistics.fmean(t), "p90": sorted(t)[int(0.9 * len(t))],
                      "n": len(t)}
               for tier, t in times.items()}
    return {"bench": "tier-costs", "blob_bytes": nbytes, "shape_LTHD": list(SHAPE), "dtype": "bfloat16",
            "blobs": n, "rounds": rounds, "time": time.strftime("%Y-%m-%d %H:%M:%S"), "seconds": summary,
            "raw": times}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blobs", type=int, default=50, help="blobs per round (default: 50, one k=50 request)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--out", type=Path, default=Path("docs/results/tier-costs.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvmem-tiers-") as work:
        result = measure(Path(work), args.blobs, args.rounds)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for tier, s in result["seconds"].items():
        print(f"{tier:5s} median {s['median'] * 1e3:.3f} ms  p90 {s['p90'] * 1e3:.3f} ms  (n={s['n']})")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
