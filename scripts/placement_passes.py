"""What the injection step's placement costs on this host, pass by pass, at a LoCoMo-like k=50.

    python scripts/placement_passes.py [--tokens 1000] [--reps 25]

SmolLM2-135M's cache shape (30 layers, 3 KV heads, head size 64, bf16, block size 32), N staged
tokens from 50 blobs. Times, interleaved over repetitions (median and best), each pass of the
worker's placement (kvmem/connector/worker_side.py, placement.py) and two restructurings of it:
- today: blobs concatenated into the staging buffer; per layer, the key copied to float32, moved
  with vLLM's rotary kernel, rounded back, and written with the CPU backend's cache-update op;
- all layers at once: one float32 copy, one kernel call and one rounding for every layer, then
  the per-layer writes (what "vectorised across layers" would buy);
- the passes alone: concatenation, float32 copy, kernel, rounding, the writes.
Every variant writes the same cache bytes (checked). Issue 52 item 3, docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from vllm import _custom_ops as ops

L, H, D, BS, FACTS = 30, 3, 64, 32, 50


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--reps", type=int, default=25)
    args = ap.parse_args()
    n = args.tokens - args.tokens % FACTS
    torch.manual_seed(0)
    blocks = n // BS + 4
    caches = [torch.zeros(blocks, H, 2 * BS, D, dtype=torch.bfloat16) for _ in range(L)]  # the CPU backend's pages
    blobs = [(torch.randn(L, n // FACTS, H, D).bfloat16(), torch.randn(L, n // FACTS, H, D).bfloat16())
             for _ in range(FACTS)]
    slots = torch.arange(n) + BS
    rows = torch.randn(n, D)  # a move per token: [N, rot] float32, as rope.move_rows makes
    positions, every = torch.arange(n), torch.arange(n).repeat(L)
    key, value = (torch.empty(L, n, H, D, dtype=torch.bfloat16) for _ in range(2))
    key32, key16 = torch.empty(L, n, H, D), torch.empty(L, n, H, D, dtype=torch.bfloat16)

    def write(i, k, v):
        kc, vc = caches[i].chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, "vec", k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")

    def concat():
        torch.cat([b[0] for b in blobs], dim=1, out=key)
        torch.cat([b[1] for b in blobs], dim=1, out=value)

    def today():
        concat()
        for i in range(L):
            k = key[i].to(torch.float32, copy=True)
            ops.rotary_embedding(positions, k.view(n, H * D), None, D, rows, True)
            write(i, k.to(torch.bfloat16), value[i])

    def all_layers():
        concat()
        key32.copy_(key)
        ops.rotary_embedding(every, key32.view(L * n, H * D), None, D, rows, True)
        key16.copy_(key32)
        for i in range(L):
            write(i, key16[i], value[i])

    variants = {"today": today, "all layers at once": all_layers, "pass: concatenation": concat,
                "pass: float32 copy": lambda: key32.copy_(key),
                "pass: rotary kernel": lambda: ops.rotary_embedding(every, key32.view(L * n, H * D), None, D, rows, True),
                "pass: rounding to bf16": lambda: key16.copy_(key32),
                "pass: cache writes": lambda: [write(i, key[i], value[i]) for i in range(L)]}
    today()
    expected = [c.clone() for c in caches]
    all_layers()
    assert all(torch.equal(a, b) for a, b in zip(expected, caches)), "the variants wrote different bytes"
    times = {name: [] for name in variants}
    for _ in range(args.reps):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e3)
    print(f"{n} tokens x {L} layers, K+V {2 * n * L * H * D * 2 / 1e6:.1f} MB, torch threads {torch.get_num_threads()}\n")
    print("| variant | median ms | best ms |\n|---|---|---|")
    for name, t in times.items():
        print(f"| {name} | {statistics.median(t):.2f} | {min(t):.2f} |")


if __name__ == "__main__":
    main()
