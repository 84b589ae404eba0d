"""Lab (PyTorch, fp32, no vLLM): learned bridge tokens after the facts (issue 40's fallback).

Trains B soft tokens (tune/bridge.py; model frozen, the shipped KV map on the facts unless
--map off) on LoCoMo's tuning conversations, then measures KV mode with and without them against
text prefill on the reporting conversations, which no tuning saw: first-token and reply KL,
top-1 and tie-aware first-token agreement (measure.compare, tie_aware), paired per chat with a
bootstrap interval on the difference.

    python scripts/bridge_lab.py --home /tmp/rc-home --tokens 4,16,64 --out docs/results/bridge-lab.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvmem.bench.metrics import bootstrap_ci  # noqa: E402
from kvmem.config import Config  # noqa: E402
from kvmem.reader import adapters, kvmap  # noqa: E402
from kvmem.service import KVMem  # noqa: E402
from kvmem.tune import bridge  # noqa: E402
from kvmem.tune.cli import REPORT_CONVERSATIONS  # noqa: E402
from kvmem.tune.examples import locomo_examples  # noqa: E402
from kvmem.tune.measure import summarize  # noqa: E402
from kvmem.tune.split import TUNE_CONVERSATIONS  # noqa: E402
from kvmem.tune.train import eos_ids, load_model, teacher_targets  # noqa: E402


def paired(a: list[float], b: list[float]) -> dict[str, float]:
    """Mean of b - a per chat and its 95% bootstrap interval."""
    mean, lo, hi = bootstrap_ci([y - x for x, y in zip(a, b)], iters=2000)
    return {"mean": mean, "lo": lo, "hi": hi}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--home", type=Path, required=True)
    ap.add_argument("--data", type=Path, default=Path("../shared/data/locomo/locomo_dev.json"))
    ap.add_argument("--tokens", default="16", help="bridge tokens B, comma-separated: one bridge trained per value")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--first-weight", type=float, default=2.0)
    ap.add_argument("--limit", type=int, default=0, help="training questions per conversation (0: all)")
    ap.add_argument("--eval-limit", type=int, default=20, help="held-out questions per conversation")
    ap.add_argument("--map", choices=("on", "off"), default="on")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    configs = [bridge.BridgeConfig(tokens=int(b), lr=args.lr, epochs=args.epochs, first_weight=args.first_weight)
               for b in args.tokens.split(",")]
    with KVMem(Config(home=args.home), start_engine=False, background=False) as mem:
        train = [ex for _, ex in locomo_examples(mem, args.data, TUNE_CONVERSATIONS, k=10, limit=args.limit or None)]
        held = [ex for _, ex in locomo_examples(mem, args.data, REPORT_CONVERSATIONS, k=10, limit=args.eval_limit)]
        info, eos, tok = mem.model, eos_ids(mem.prompts.tokenizer), mem.prompts.tokenizer
    model = load_model(info.path)
    kv_map = kvmap.load(adapters.SHIPPED / adapters.folder_name(info.fingerprint)) if args.map == "on" else None
    memory = bridge.Memory(model, kv_map)
    started = time.perf_counter()
    work = args.out.with_suffix(".work")
    work.mkdir(parents=True, exist_ok=True)
    targets = teacher_targets(model, [], train, eos, 16, work)
    newline = tok.encode("\n", add_special_tokens=False)[-1]
    bridges, training = {}, {}
    for cfg in configs:
        t0 = time.perf_counter()
        init = bridge.initial(model, newline, cfg.tokens, cfg.seed)
        learned, losses = bridge.train(model, train, targets, memory, init, cfg)
        tenth = max(1, len(losses) // 10)
        training[cfg.tokens] = {"seconds": round(time.perf_counter() - t0, 1),
                                "loss_first_tenth": statistics.fmean(losses[:tenth]),
                                "loss_last_tenth": statistics.fmean(losses[-tenth:])}
        bridges[f"kv+bridge-{cfg.tokens} (initial)"] = init
        bridges[f"kv+bridge-{cfg.tokens}"] = learned
    rows = bridge.evaluate(model, held, eos, memory, bridges)
    keys = ("first_kl", "first_agree", "first_agree_tie_aware", "reply_kl")
    result = {"command": "python " + " ".join(sys.argv), "model": info.path.name,
              "config": {k: v for k, v in configs[0].__dict__.items() if k != "tokens"},
              "kv_map": args.map, "train_conversations": list(TUNE_CONVERSATIONS), "train_chats": len(train),
              "eval_conversations": list(REPORT_CONVERSATIONS), "eval_chats": len(held),
              "seconds": round(time.perf_counter() - started, 1), "training": training,
              "rows": {name: summarize(r) for name, r in rows.items()},
              "paired_minus_kv": {name: {key: paired([r[key] for r in rows["kv"]], [r[key] for r in rs]) for key in keys}
                                  for name, rs in rows.items() if name != "kv"}}
    args.out.write_text(json.dumps(result, indent=1))
    for f in work.iterdir():
        f.unlink()
    work.rmdir()
    for name, row in result["rows"].items():
        print(f"{name:22s} " + "  ".join(f"{k} {v:.4f}" for k, v in row.items()))
    print(json.dumps(result["paired_minus_kv"], indent=1))


if __name__ == "__main__":
    main()
