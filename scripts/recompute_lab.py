"""Lab sweep (PyTorch, fp32, no vLLM): selective recompute rules x budgets, with and without the
reader's KV map, against text prefill (issue 40). Tuning conversations only by default.

Each chat is measured as `kvmem tune-reader` measures its chats (tune/measure.compare: first-token
and reply KL and top-1 agreement, teacher-forcing text prefill's own 16-token greedy reply), plus
tie-aware first-token agreement: where text prefill's two best first tokens are within bf16
resolution of each other (|a - b| <= 2^-8 * max(|a|, |b|), log-probabilities), the chat counts as
agreeing if KV mode's top token is either of them.

Rules (kv/recompute.py): deviation (CacheBlend), first (EPIC), last, oracle (lab only); and
"best-last": the facts ordered by retrieval score with the best last (both modes read that
order), then deviation. Compute is recompute's token-layers over text prefill's (blend.flops_fraction).

    python scripts/recompute_lab.py --home /tmp/rc-home --out docs/results/recompute-lab-tune.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvmem.config import Config  # noqa: E402
from kvmem.kv.recompute import Recompute  # noqa: E402
from kvmem.reader import adapters, kvmap  # noqa: E402
from kvmem.service import KVMem  # noqa: E402
from kvmem.tune.blend import blend, flops_fraction, text_cache  # noqa: E402
from kvmem.tune.examples import from_records  # noqa: E402
from kvmem.tune.lab import FactKV, memory_cache, reply_logits, teacher_reply  # noqa: E402
from kvmem.tune.measure import compare, tie_aware  # noqa: E402
from kvmem.tune.split import TUNE_CONVERSATIONS as TUNE  # noqa: E402
from kvmem.tune.train import eos_ids, load_model  # noqa: E402

RULES = ("deviation", "first", "last", "oracle", "best-last")


def examples(mem, data: Path, convs, k: int, limit: int, seed: int):
    """Per sampled question: (key, Example in stored order, Example with the best fact last)."""
    from kvmem.bench import locomo
    from kvmem.bench.eval_locomo import EvalConfig, build_memory

    cfg = EvalConfig(data=data, conversations=tuple(convs), k=k, memory="observations", limit=limit, seed=seed)
    out = []
    for conv in locomo.load(cfg.data):
        if conv["sample_id"] not in convs:
            continue
        user = build_memory(mem, conv, cfg, encode=False)
        for i, q in locomo.sample_questions(conv, limit, seed):
            hits = mem.search(q["question"], user_id=user, k=k, ranking=cfg.ranking)
            ranked = [mem.get(h.id) for h in hits]  # best first
            stored = sorted(ranked, key=lambda r: (r.created_at, r.position or 0, r.id))
            msgs = [{"role": "user", "content": q["question"]}]
            out.append((f"{conv['sample_id']}#{i}", from_records(mem.prompts, stored, msgs),
                        from_records(mem.prompts, ranked[::-1], msgs)))
    return out


def measure(model, ex, reply, teacher, layers, rec, kv_map, text_layers, n_layers):
    if kv_map is not None:
        layers = kvmap.apply(layers, len(ex.head), len(ex.memory_ids), kv_map)
    out = blend(model, ex, layers, rec, text_layers=text_layers)
    student = reply_logits(model, ex, reply, out.layers)
    row = compare(teacher, student)
    row["first_agree_tie_aware"] = tie_aware(teacher, student)
    row["compute_fraction"] = flops_fraction(ex, out, n_layers)
    row["recomputed_fraction"] = out.recomputed / max(1, len(ex.memory_ids) - len(ex.head))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--home", type=Path, required=True)
    ap.add_argument("--data", type=Path, default=Path("../shared/data/locomo/locomo_dev.json"))
    ap.add_argument("--conversations", default=",".join(TUNE))
    ap.add_argument("--limit", type=int, default=15, help="questions per conversation")
    ap.add_argument("--budgets", default="0.025,0.05,0.1,0.15")
    ap.add_argument("--rules", default=",".join(RULES))
    ap.add_argument("--maps", default="off,on", help="without and/or with the shipped KV map")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    convs = tuple(args.conversations.split(","))
    budgets = [float(b) for b in args.budgets.split(",")]
    with KVMem(Config(home=args.home), start_engine=False, background=False) as mem:
        chats = examples(mem, args.data, convs, 10, args.limit, 0)
        info, eos = mem.model, eos_ids(mem.prompts.tokenizer)
    model = load_model(info.path)
    n_layers = model.config.num_hidden_layers
    shipped = kvmap.load(adapters.SHIPPED / adapters.folder_name(info.fingerprint))
    maps = {"off": None, "on": shipped}
    variants = [(m, rule, b) for m in args.maps.split(",") for rule in args.rules.split(",") for b in budgets]
    variants = [(m, "none", 0.0) for m in args.maps.split(",")] + variants
    rows = {f"{m}/{r}/{b:g}": [] for m, r, b in variants}
    facts, started = FactKV(), time.time()
    with torch.no_grad():
        for n, (key, stored, best_last) in enumerate(chats):
            per_order = {}
            for m, rule, b in variants:
                ex = best_last if rule == "best-last" else stored
                if id(ex) not in per_order:
                    reply, teacher = teacher_reply(model, ex, 16, eos)
                    per_order[id(ex)] = (reply, teacher, memory_cache(model, ex, facts=facts),
                                         text_cache(model, ex) if "oracle" in args.rules else None)
                reply, teacher, layers, text_layers = per_order[id(ex)]
                rec = Recompute(b, "deviation" if rule in ("best-last", "none") else rule)
                rows[f"{m}/{rule}/{b:g}"].append(measure(model, ex, reply, teacher, layers, rec, maps[m],
                                                         text_layers, n_layers))
            print(f"{n + 1}/{len(chats)} {time.time() - started:.0f}s", end="\r", flush=True)
    summary = {name: {k: statistics.fmean(r[k] for r in rs) for k in rs[0]} for name, rs in rows.items()}
    result = {"command": "python " + " ".join(sys.argv), "conversations": convs, "chats": len(chats),
              "model": str(info.path.name), "prompt_tokens": statistics.fmean(len(c[1].ids) for c in chats),
              "fact_tokens": statistics.fmean(len(c[1].memory_ids) - len(c[1].head) for c in chats),
              "rows": summary, "first_agree_per_chat": {n: [r["first_agree"] for r in rs] for n, rs in rows.items()}}
    args.out.write_text(json.dumps(result, indent=1))
    print()
    for name, row in summary.items():
        print(f"{name:22s} " + "  ".join(f"{k} {v:.4f}" for k, v in row.items()))


if __name__ == "__main__":
    main()
