"""Gathering a step's blobs into the staging buffer, from cache and from memory (docs/benchmarks.md,
"Why staging costs what it does").

101 blobs of SmolLM2-135M's shape ([30 layers, 12-27 tokens, 3 KV heads, 64] bf16, ~23 MB per
role) are concatenated along the token axis as the worker's staging does (numpy, same-size ints),
all layers in one call and layer by layer, each timed with the blobs in cache ("hot") and after a
600 MB pass evicted them ("cold"), as they are when a step's forward has run before the load.
Prints medians of 7, in ms. Usage: python scripts/staging_cold.py
"""

import time

import numpy as np
import torch

LAYERS, HEADS, DIM = 30, 3, 64


def median_ms(fn, evict=None, reps: int = 7) -> float:
    times = []
    for _ in range(reps):
        if evict is not None:
            evict()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return round(sorted(times)[reps // 2], 2)


def main() -> None:
    lengths = np.random.default_rng(0).integers(12, 28, size=101)
    blobs = [torch.randn(LAYERS, int(t), HEADS, DIM).to(torch.bfloat16) for t in lengths]
    views = [b.view(torch.int16).numpy() for b in blobs]
    n = int(lengths.sum())
    junk = np.ones(600 * 1024 * 1024 // 8)
    out = torch.empty(LAYERS, n, HEADS, DIM, dtype=torch.bfloat16)
    layer_out = torch.empty(n, HEADS, DIM, dtype=torch.bfloat16).view(torch.int16).numpy()
    as_float = torch.empty(LAYERS, n, HEADS, DIM)

    def all_layers():
        np.concatenate(views, axis=1, out=out.view(torch.int16).numpy())

    def by_layer():
        for layer in range(LAYERS):
            np.concatenate([v[layer] for v in views], axis=0, out=layer_out)

    print(f"{n} tokens, {out.numel() * 2 / 1e6:.1f} MB per role")
    for name, fn in (("all layers", all_layers), ("by layer", by_layer),
                     ("bf16 -> float32 into a kept buffer", lambda: as_float.copy_(out))):
        print(f"{name}: hot {median_ms(fn)} ms, cold {median_ms(fn, evict=junk.sum)} ms")


if __name__ == "__main__":
    main()
