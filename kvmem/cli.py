"""kvmem command line. `kvmem demo` runs the main job on the embedded defaults."""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import replace
from pathlib import Path

from kvmem.config import Config
from kvmem.errors import KvmemError

DEMO_USER = "demo-user"
DEMO_FACTS = [
    "My name is Sam Rivera and I live in Lisbon, Portugal.",
    "I work as a pediatric nurse at Santa Maria hospital.",
    "My wife Ana is a marine biologist who studies octopuses.",
    "We have a golden retriever called Biscuit who is four years old.",
    "I am allergic to penicillin.",
    "My favourite food is grilled sardines with boiled potatoes.",
    "I play the cello in a community orchestra every Thursday evening.",
    "My brother Luis lives in Toronto and works as an architect.",
    "I am training for the Lisbon half marathon in March.",
    "I drive a green 2012 Toyota Yaris.",
    "My daughter Clara was born on 3 June 2019.",
    "I do not drink coffee; I prefer green tea.",
]
DEMO_QUESTIONS = [
    "What is my dog's name?",
    "Which instrument do I play?",
    "What medicine am I allergic to?",
]


def demo(config: Config) -> int:
    from kvmem.service import KVMem

    print("kvmem demo: starting vLLM with the kvmem connector (the first run converts the model)...", flush=True)
    with KVMem(config) as mem:
        facts = [mem.add_fact(DEMO_USER, text) for text in DEMO_FACTS]
        report = mem.encode()
        per_token = mem.model.kv_bytes_per_token(_itemsize(config.kv.key_dtype), _itemsize(config.kv.value_dtype or mem.model.dtype))
        print(f"\nmodel {mem.model.path.name} ({mem.model.num_layers} layers, {mem.model.num_kv_heads} KV heads x "
              f"{mem.model.head_size}); KV {per_token:,} bytes/token; encoded {report.encoded} facts in {report.seconds:.2f} s")
        ids = [f.id for f in facts]
        mem.chat(DEMO_USER, "Hello!", ids, mode="text", max_tokens=1)  # warm-up, not timed
        mem.chat(DEMO_USER, "Hello!", ids, mode="kv", max_tokens=1)
        for i, question in enumerate(DEMO_QUESTIONS):
            order = ids[i + 1 :] + ids[: i + 1]  # a new fact order per question: text mode cannot reuse a cached prefix
            text = mem.chat(DEMO_USER, question, order, mode="text", max_tokens=48)
            kv = mem.chat(DEMO_USER, question, order, mode="kv", max_tokens=48)
            print(f"\nQ: {question}   ({text.prompt_tokens} prompt tokens, {len(order)} facts)")
            print(f"  text  TTFT {text.ttft_s * 1000:7.1f} ms | {text.answer}")
            print(f"  kv    TTFT {kv.ttft_s * 1000:7.1f} ms | {kv.answer}")
            print(f"        {kv.injected_tokens} tokens injected, {kv.fallbacks} fallbacks, "
                  f"TTFT text/kv = {text.ttft_s / kv.ttft_s:.1f}x")
    return 0


def _itemsize(dtype: str) -> int:
    import torch

    return torch.empty(0, dtype=getattr(torch, dtype)).element_size()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvmem", description=__doc__)
    parser.add_argument("--home", type=Path, help="data folder (default: $KVMEM_HOME or ~/.cache/kvmem)")
    parser.add_argument("--model", help="a local HF model folder or hub id (default: bundled SmolLM2-135M)")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="store a dozen facts, ask three questions in text and KV mode")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    config = Config.from_env()
    if args.home:
        config = replace(config, home=args.home)
    if args.model:
        config = replace(config, engine=replace(config.engine, model=args.model))
    try:
        return demo(config)
    except KvmemError as e:
        print(f"kvmem: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
