"""`kvmem tune-reader`: train the reader adapter for the configured model, then measure it on
conversations it never saw. Needs no engine (PyTorch only); minutes on a CPU for the bundled model.

It trains on the tuning set kvmem ships (tuning_set.py: synthetic conversations, no outside
data) unless --data names LoCoMo-shaped conversations; it measures on LoCoMo's reporting
conversations when that file is there (--eval-data), and says so and skips the measurement when not."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from kvmem.argtypes import non_negative_int
from kvmem.bench import locomo
from kvmem.bench.cli import RESULTS as BENCH_RESULTS
from kvmem.bench.cli import data_options
from kvmem.reader.targets import TARGETS
from kvmem.tune.split import TUNE_CONVERSATIONS

REPORT_CONVERSATIONS = ("conv-42", "conv-43", "conv-44", "conv-47")


def _ids(text: str) -> tuple[str, ...]:
    return tuple(x for x in text.split(",") if x)


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _memories(text: str) -> tuple[str, ...]:
    from kvmem.bench.eval_locomo import DEFAULT_WINDOW

    names = tuple(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    unknown = [t for t in names if t not in DEFAULT_WINDOW]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"expected names among {','.join(DEFAULT_WINDOW)}, got {text!r}")
    return names


def _targets(text: str) -> tuple[str, ...]:
    if text.strip() == "none":
        return ()
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    unknown = [t for t in names if t not in TARGETS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"expected names among {','.join(TARGETS)}, got {text!r}")
    return tuple(t for t in TARGETS if t in names)


def add_parser(sub) -> None:
    p = sub.add_parser("tune-reader", help="train the reader adapter (a KV map of the injected facts, optionally a LoRA) by distilling text prefill",
                       description=__doc__)
    p.add_argument("--data", type=Path, default=None,
                   help="training conversations, LoCoMo-shaped JSON (default: the tuning set kvmem ships, "
                        "kvmem/tune/data/tuning_set.json; LoCoMo itself is read by path, never copied)")
    p.add_argument("--conversations", type=_ids, default=None,
                   help="training conversations (default: all of the shipped tuning set; with --data, "
                        f"{','.join(TUNE_CONVERSATIONS)}, LoCoMo's tuning split)")
    p.add_argument("--eval-data", type=Path, default=locomo.DEFAULT_PATH,
                   help="held-out conversations, LoCoMo JSON (default: ../shared's LoCoMo; when it is missing the "
                        "measurement is skipped)")
    p.add_argument("--eval-conversations", type=_ids, default=REPORT_CONVERSATIONS,
                   help=f"held-out conversations to measure on; '' for none (default: {','.join(REPORT_CONVERSATIONS)})")
    p.add_argument("--memory", type=_memories, default=("observations", "both"), metavar="KINDS",
                   help="comma-separated memories the chats read, as `kvmem eval locomo --memory` stores them: "
                        "observations, turns, both (observations + turns, each turn after its 2 before); "
                        "training takes each question once per memory, and each memory is measured on its own "
                        "(default: observations,both, as the shipped map was trained)")
    p.add_argument("--limit", type=int, default=0, help="training questions per conversation; 0 for all (default)")
    p.add_argument("--turn-questions", type=non_negative_int, default=0, metavar="N",
                   help="also train on the conversations' own turns that end in '?', each as a user's message: "
                        "N per conversation drawn at random (more than a conversation has: all of them), 0 for none "
                        "(default: 0; all of them, 1 epoch, measured no better: docs/benchmarks.md)")
    p.add_argument("--eval-limit", type=int, default=20, help="held-out questions per conversation (default: 20)")
    p.add_argument("-k", type=int, default=10, help="facts per chat (default: 10)")
    p.add_argument("--epochs", type=int, default=1,
                   help="passes over the training chats (default: 1; the LoRA recipes of docs/benchmarks.md ran 2 "
                        "over observation memory alone)")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=_positive_float, default=None,
                   help="LoRA alpha; the update is scaled by alpha / rank (default: 2 x rank, the scale of the shipped adapter)")
    p.add_argument("--targets", type=_targets, default=(), metavar="NAMES",
                   help="comma-separated linear layers a LoRA adapts, among " + ",".join(TARGETS) +
                        ", or 'none' (default: none: the KV map alone, which costs the engine no compute per token)")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate of the LoRA (default: 1e-3)")
    p.add_argument("--reply-tokens", type=int, default=16, help="teacher reply length distilled (default: 16)")
    p.add_argument("--first-weight", type=_positive_float, default=1.0,
                   help="weight of the reply's first token in the loss, the others 1 (default: 1)")
    p.add_argument("--no-kv-map", dest="kv_map", action="store_false",
                   help="train the LoRA alone, without the KV map of the injected facts (needs --targets)")
    p.add_argument("--map-lr", type=_positive_float, default=3e-3, help="learning rate of the KV map (default: 3e-3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None,
                   help="adapter folder (default: <home>/adapters/<model fingerprint>, which serving picks up)")
    p.add_argument("--results", type=Path, default=None, help="results JSON (default: docs/results/reader.json)")
    p.set_defaults(func=cmd_tune_reader)


def tune_config(args: argparse.Namespace):
    """The training settings of a `tune-reader` command line."""
    from kvmem.tune.train import TuneConfig

    return TuneConfig(rank=args.rank, alpha=args.alpha or 2.0 * args.rank, lr=args.lr, epochs=args.epochs,
                      reply_tokens=args.reply_tokens, seed=args.seed, first_weight=args.first_weight,
                      targets=args.targets, kv_map=args.kv_map, map_lr=args.map_lr)


def cmd_tune_reader(args: argparse.Namespace, config) -> int:
    from kvmem.reader import adapters, kvmap, lora
    from kvmem.tune import tuning_set
    from kvmem.tune.train import evaluate, tune

    data, conversations = checked_data(args)
    try:
        cfg = tune_config(args)
    except ValueError as e:
        raise SystemExit(f"kvmem tune-reader: {e}") from e
    model, model_info, eos, train, held = gather(args, config, data, conversations)
    out = args.out or adapters.user_folder(config.home, model_info.fingerprint)
    meta = {"fingerprint": model_info.fingerprint, "model": str(model_info.path),
            "data": "shipped tuning set" if data == tuning_set.PATH else str(data),
            "conversations": list(conversations), "memory": list(args.memory), "k": args.k,
            "trained_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    report = tune(model, train, eos, out, cfg, meta)
    print(f"adapter: {out} ({report.steps} steps, {report.seconds / 60:.1f} min); "
          f"KL over the first tenth {report.first_loss:.4f}, last tenth {report.last_loss:.4f}")
    result = {"command": "kvmem " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
              "train_data": meta["data"], "train_conversations": list(conversations), "memory": list(args.memory),
              "train_examples": len(train),
              "train_turn_questions_per_conversation": args.turn_questions,
              "tune": {**cfg.__dict__}, "steps": report.steps, "seconds": round(report.seconds, 1),
              "loss_first_tenth": report.first_loss, "loss_last_tenth": report.last_loss}
    if held:
        wrapped = [(n, m) for n, m in model.named_modules() if isinstance(m, lora.LoRALinear)]
        result["eval_conversations"] = list(args.eval_conversations)
        result["eval_examples"] = {memory: len(examples) for memory, examples in held.items()}
        result["eval"] = {memory: evaluate(model, wrapped, examples, eos, args.reply_tokens, kv_map=kvmap.load(out))
                          for memory, examples in held.items()}
        for memory, rows in result["eval"].items():
            for name, row in rows.items():
                print(f"{memory:12s} {name:12s} " + "  ".join(f"{k} {v:.4f}" for k, v in row.items()))
    path = args.results or Path("docs/results/reader.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(f"results: {path}")
    return 0


def checked_data(args: argparse.Namespace) -> tuple[Path, tuple[str, ...]]:
    """(training file, its conversations); the held-out side dropped, and said so, when its file
    is missing; SystemExit when a conversation would be trained and measured on."""
    data, conversations = training_data(args.data, args.conversations)
    if args.eval_conversations and not args.eval_data.is_file():
        print(f"kvmem tune-reader: no held-out data at {args.eval_data}: training only, nothing measured "
              "(pass --eval-data LOCOMO_JSON to measure)", file=sys.stderr)
        args.eval_conversations = ()
    overlap = set(conversations) & set(args.eval_conversations)
    if overlap and data.resolve() == args.eval_data.resolve():
        raise SystemExit(f"kvmem tune-reader: {sorted(overlap)} would be trained on and evaluated on")
    return data, conversations


def gather(args: argparse.Namespace, config, data: Path, conversations: tuple[str, ...]):
    """-> (model, its ModelInfo, eos ids, training Examples, {memory: held-out Examples}); the
    model's rotary checked first (seconds), before the examples (minutes)."""
    from kvmem.errors import UnsupportedConfigError
    from kvmem.service import KVMem
    from kvmem.tune.examples import locomo_examples
    from kvmem.tune.lab import check_rotary
    from kvmem.tune.train import eos_ids, load_model

    with KVMem(config, start_engine=False, background=False) as mem:
        model = load_model(mem.model.path)
        try:
            check_rotary(model)
        except UnsupportedConfigError as e:
            raise SystemExit(f"kvmem tune-reader: {e}") from e
        train, held = [], {}
        for memory in args.memory:
            train += [ex for _, ex in locomo_examples(mem, data, conversations, k=args.k, memory=memory,
                                                      limit=args.limit or None, seed=args.seed)]
            if args.turn_questions:
                train += [ex for _, ex in locomo_examples(mem, data, conversations, k=args.k, seed=args.seed,
                                                          memory=memory, limit=args.turn_questions, asked="turns")]
            if args.eval_conversations:
                held[memory] = [ex for _, ex in locomo_examples(mem, args.eval_data, args.eval_conversations, k=args.k,
                                                                memory=memory, limit=args.eval_limit or None,
                                                                seed=args.seed)]
        return model, mem.model, eos_ids(mem.prompts.tokenizer), train, held


def training_data(data: Path | None, conversations: tuple[str, ...] | None) -> tuple[Path, tuple[str, ...]]:
    """(file, conversation ids) to train on: the shipped tuning set, all of it, unless told."""
    from kvmem.tune import tuning_set

    if data is None:
        data = tuning_set.PATH
    if conversations is None:
        conversations = (tuple(c["sample_id"] for c in locomo.load(data)) if data == tuning_set.PATH
                         else TUNE_CONVERSATIONS)
    return data, conversations


def add_bench_parser(bench) -> None:
    """`kvmem bench reader` (in the bench table, made here: it measures with the tuning lab)."""
    rd = bench.add_parser("reader", help="where KV mode's answers part from text prefill: positions, header, "
                                         "cross-fact attention (PyTorch, no engine)")
    rd.add_argument("--conversations", type=_ids, default=TUNE_CONVERSATIONS,
                    help="comma-separated sample ids (default: the tuning ones)")
    rd.add_argument("--limit", type=int, default=15, help="questions per conversation (default: 15)")
    rd.add_argument("-k", type=int, default=10)
    data_options(rd, "reader")
    rd.set_defaults(func=cmd_reader)


def cmd_reader(args, config) -> int:
    import json

    from kvmem.tune.examples import locomo_examples
    from kvmem.tune.measure import LAYOUTS, diagnose
    from kvmem.tune.train import eos_ids, load_model
    from kvmem.service import KVMem

    with KVMem(config, start_engine=False, background=False) as mem:
        examples = [ex for _, ex in locomo_examples(mem, args.data, args.conversations, k=args.k,
                                                    limit=args.limit or None, seed=args.seed)]
        path, eos = mem.model.path, eos_ids(mem.prompts.tokenizer)
    result = {"bench": "reader", "conversations": list(args.conversations), "limit_per_conversation": args.limit,
              "k": args.k, "examples": len(examples), "reply_tokens": 16,
              "layouts": diagnose(load_model(path), examples, eos, LAYOUTS)}
    out = (args.out or BENCH_RESULTS) / "reader-diagnosis.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    for name, row in result["layouts"].items():
        print(f"{name:42s} " + "  ".join(f"{key} {value:.4f}" for key, value in row.items()))
    print(f"results: {out}")
    return 0
