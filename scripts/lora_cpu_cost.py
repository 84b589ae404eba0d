"""What the reader adapter costs per layer on vLLM's CPU backend, and why.

vLLM's CPU LoRA path (vllm/lora/ops/torch_ops) gathers one copy of the adapter's matrices per
token (`lora_weights[token_indices]`: [T, r, hidden] and [T, out, r]) and multiplies them with
a batched einsum; a single adapter could be one matmul over all T tokens. This times both on the
bundled model's query projection (hidden 576, rank 8), in the serving dtype and in float32.

    .venv/bin/python scripts/lora_cpu_cost.py
"""

from __future__ import annotations

import time

import torch
from vllm.lora.ops.torch_ops import bgmv_expand, bgmv_shrink

HIDDEN, RANK, LAYERS = 576, 8, 30  # SmolLM2-135M: q_proj 576 -> 576, 30 layers; the shipped adapter is rank 8


def ms(fn, n: int = 10) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e3


def main() -> None:
    torch.set_num_threads(2)
    print(f"per layer, one q slice, hidden {HIDDEN}, rank {RANK}; x{LAYERS} layers per prefill step")
    for dtype in (torch.bfloat16, torch.float32):
        for tokens in (64, 450):
            a = torch.randn(1, 1, RANK, HIDDEN, dtype=dtype)  # [max_loras, 1, r, hidden]
            b = torch.randn(1, 1, HIDDEN, RANK, dtype=dtype)  # [max_loras, 1, out, r]
            x = torch.randn(tokens, HIDDEN, dtype=dtype)  # [T, hidden]
            index = torch.zeros(tokens, dtype=torch.long)  # every token reads adapter 0
            mid = torch.zeros(tokens, RANK, dtype=torch.float32)  # [T, r]
            y = torch.zeros(tokens, HIDDEN, dtype=dtype)  # [T, out]
            vllm = ms(lambda: bgmv_shrink(x, a, mid, index, 1.0)) + ms(lambda: bgmv_expand(mid, b, y, index, True))
            one = (ms(lambda: mid.copy_(x.float() @ a[0, 0].float().T))
                   + ms(lambda: y.add_((mid @ b[0, 0].float().T).to(dtype))))
            print(f"{str(dtype):>15} T={tokens:>4}: vLLM CPU ops {vllm:7.2f} ms, one matmul each {one:5.2f} ms "
                  f"({vllm / one:4.1f}x); x{LAYERS} layers: {vllm * LAYERS:6.0f} ms against {one * LAYERS:4.0f} ms")


if __name__ == "__main__":
    main()
