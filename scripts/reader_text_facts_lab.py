"""Lab (PyTorch, no vLLM): KV mode with its last m facts prefilled as text (kv.text_facts).

Each chat is measured as `kvmem tune-reader` measures its held-out chats (measure.compare:
first-token and reply KL and top-1 agreement against text prefill's own greedy reply), with and
without the shipped KV map, and with the last 1, 2, 3 facts moved from the injected memory into
the computed tail (the prompt's tokens are unchanged; only what is computed moves).

    python scripts/reader_text_facts_lab.py --home /tmp/tune-mixed --split tune --out docs/results/reader-text-facts-tune.json
    python scripts/reader_text_facts_lab.py --home /tmp/tune-mixed --split report --out docs/results/reader-text-facts-report.json

--home: a kvmem home (facts are stored there as `eval locomo` stores them; no engine needed).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvmem.config import Config  # noqa: E402
from kvmem.reader import adapters, kvmap  # noqa: E402
from kvmem.tune.examples import locomo_examples  # noqa: E402
from kvmem.tune.lab import Example, FactKV, memory_cache, reply_logits, teacher_reply  # noqa: E402
from kvmem.tune.measure import compare, summarize  # noqa: E402
from kvmem.tune.train import eos_ids, load_model  # noqa: E402
from kvmem.service import KVMem  # noqa: E402

SPLITS = {"tune": (("conv-26", "conv-30", "conv-41"), 15), "report": (("conv-42", "conv-43", "conv-44", "conv-47"), 20)}
VARIANTS = [("kv", 0, False), ("kv+map", 0, True), ("kv+map, last 1 as text", 1, True),
            ("kv+map, last 2 as text", 2, True), ("kv+map, last 3 as text", 3, True), ("kv, last 2 as text", 2, False)]


def with_text_tail(ex: Example, m: int) -> Example:
    """The same prompt with its last m facts moved from the injected memory into the computed tail."""
    m = min(m, len(ex.facts))
    if m == 0:
        return ex
    moved = tuple(t for _, fact in ex.facts[len(ex.facts) - m:] for t in fact)
    return Example(ex.head, ex.facts[: len(ex.facts) - m], moved + ex.tail)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--home", type=Path, required=True)
    ap.add_argument("--data", type=Path, default=Path("../shared/data/locomo/locomo_dev.json"))
    ap.add_argument("--split", choices=SPLITS, required=True)
    ap.add_argument("--memory", default="observations")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    convs, limit = SPLITS[args.split]
    with KVMem(Config(home=args.home), start_engine=False, background=False) as mem:
        examples = [ex for _, ex in locomo_examples(mem, args.data, convs, k=10, memory=args.memory, limit=limit, seed=0)]
        info, eos = mem.model, eos_ids(mem.prompts.tokenizer)
    model = load_model(info.path)
    kv_map = kvmap.load(adapters.SHIPPED / adapters.folder_name(info.fingerprint))
    facts, rows = FactKV(), {name: [] for name, _, _ in VARIANTS}
    with torch.no_grad():
        for i, ex in enumerate(examples):
            reply, teacher = teacher_reply(model, ex, 16, eos)
            for name, m, use_map in VARIANTS:
                moved = with_text_tail(ex, m)
                layers = memory_cache(model, moved, facts=facts)
                if use_map:
                    layers = kvmap.apply(layers, len(moved.head), len(moved.memory_ids), kv_map)
                rows[name].append(compare(teacher, reply_logits(model, moved, reply, layers)))
            print(f"{i + 1}/{len(examples)}", end="\r", flush=True)
    result = {"command": "python " + " ".join(sys.argv), "split": args.split, "conversations": convs,
              "memory": args.memory, "chats": len(examples),
              "fact_tokens_per_chat": sum(len(e.memory_ids) - len(e.head) for e in examples) / len(examples),
              "text_tail_tokens": {m: sum(len(with_text_tail(e, m).tail) - len(e.tail) for e in examples) / len(examples)
                                   for m in (1, 2, 3)},
              "rows": {name: summarize(r) for name, r in rows.items()},
              "first_agree_per_chat": {name: [r["first_agree"] for r in rs] for name, rs in rows.items()}}
    args.out.write_text(json.dumps(result, indent=1))
    for name, row in result["rows"].items():
        print(f"{name:26s} " + "  ".join(f"{k} {v:.4f}" for k, v in row.items()))


if __name__ == "__main__":
    main()
