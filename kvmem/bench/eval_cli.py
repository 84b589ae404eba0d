"""`kvmem eval locomo|extract|retrieval`: argument parsing and report writing. The options they
share with the benches (data, recompute, fidelity points) are bench/cli.py's."""

from __future__ import annotations

from kvmem.argtypes import non_negative_int, positive_int
from kvmem.bench.cli import RESULTS, codec_list, data_options, open_service, point_list, recompute_options


def add_parsers(sub) -> None:
    """`kvmem eval ...` under the top-level command table `sub`."""
    e = sub.add_parser("eval", help="answer-quality evaluations")
    ev = e.add_subparsers(dest="eval", required=True, metavar="EVAL")
    lc = ev.add_parser("locomo", help="LoCoMo QA: F1, gold-answer log-likelihood, agreement, recall; 3 modes")
    lc.add_argument("--conversations", type=lambda s: tuple(x for x in s.split(",") if x), default=(),
                    help="comma-separated sample ids (default: all)")
    lc.add_argument("-k", "--k", type=int, default=10)
    lc.add_argument("--memory", choices=("observations", "turns", "both", "extracted"), default="observations",
                    help="facts stored: LoCoMo's observations, the conversation's turns, both, or the facts "
                         "add(infer=True) extracts from it (eval extract's memory; default: observations)")
    lc.add_argument("--window", type=int, default=None,
                    help="CWE window: turns a fact is encoded after (turns: the turns before it, default 2; "
                         "observations: the turns ending at its evidence, default 0; both: the turns')")
    lc.add_argument("--observation-window", type=non_negative_int, default=None,
                    help="with --memory both: turns ending at its evidence that an observation is stored, "
                         "searched and encoded after (default: 0; 1 is the turn it restates)")
    lc.add_argument("--observation-origin", action="store_true",
                    help="observations: the turn each restates is its origin (searched with it, not encoded)")
    lc.add_argument("--limit", type=int, default=40,
                    help="questions per conversation, drawn at random (--seed); 0 for all (default: 40)")
    lc.add_argument("--workers", type=int, default=4, help="questions in flight at once (default: 4)")
    lc.add_argument("--no-noise-floor", dest="noise_floor", action="store_false",
                    help="skip the second text-mode pass (another batch) KV mode's agreement with text is read against")
    lc.add_argument("--points", type=point_list, default=(),
                    help="comma-separated fidelity points KV mode also answers at (as bench ttft --points), added "
                         "to the rows this run's log already holds: mode kv@<point>, nothing else answered again")
    lc.add_argument("--ranking", choices=("hybrid", "dense", "lexical"), default=None,
                    help="retrieval ranking (default: the configured one, hybrid)")
    lc.add_argument("--codecs", type=codec_list, default=(),
                    help="comma-separated KV codecs to answer with too, beside the lossless blobs (e.g. int8,int6)")
    lc.add_argument("--text-facts", type=non_negative_int, default=None,
                    help="KV mode prefills its last N facts as text (default: the configured kv.text_facts, "
                         "KVMEM_KV_TEXT_FACTS, 0)")
    lc.add_argument("--text-facts-rule", choices=("last", "relevant"), default=None,
                    help="which facts are prefilled as text: the last stored or the best-scored, moved last "
                         "(default: the configured kv.text_facts_rule, last)")
    recompute_options(lc)
    data_options(lc, "locomo")
    lc.set_defaults(func=cmd_locomo)
    ex = ev.add_parser("extract", help="add(messages, infer=True) on LoCoMo: extracted facts vs LoCoMo's observations "
                                       "(precision/recall by embedding match), memory size with and without "
                                       "reconciliation")
    ex.add_argument("--conversations", type=lambda s: tuple(x for x in s.split(",") if x), default=None,
                    help="comma-separated sample ids (default: the tuning split, conv-26,conv-30,conv-41)")
    ex.add_argument("--turns-per-add", type=positive_int, default=None,
                    help="turns per add call (default: 8; eval locomo --memory extracted reads the default's memory)")
    ex.add_argument("--threshold", type=float, default=0.6,
                    help="cosine similarity at which an extracted fact matches an observation (default: 0.6; "
                         "0.5 and 0.7 are reported too)")
    ex.add_argument("--sessions", type=positive_int, default=None,
                    help="only each conversation's first N sessions (default: all)")
    ex.add_argument("--workers", type=positive_int, default=3, help="conversations extracted at once (default: 3)")
    ex.add_argument("--extract-url", default=None,
                    help="an OpenAI-compatible API's base URL to extract with (default: the configured [extract] "
                         "url, else the served model); its key: KVMEM_EXTRACT_API_KEY or [extract] api_key")
    ex.add_argument("--extract-model", default=None, help="the model name sent to --extract-url")
    data_options(ex, "extract")
    ex.set_defaults(func=cmd_extract)
    rt = ev.add_parser("retrieval", help="LoCoMo evidence recall@5/10/20 per category: dense, lexical, hybrid")
    rt.add_argument("--conversations", type=lambda s: tuple(x for x in s.split(",") if x), default=(),
                    help="comma-separated sample ids (default: all)")
    rt.add_argument("--memory", choices=eval_retrieval_memories(), default="observations",
                    help="what is stored: LoCoMo's observations, the raw turns, or both (default: observations)")
    rt.add_argument("--novel", action="store_true",
                    help="skip hits whose evidence turns the hits above already cover")
    rt.add_argument("--window", type=int, default=2,
                    help="turns: the turns before each that it is stored after, searched and encoded with "
                         "(default: 2, as add(messages) does)")
    rt.add_argument("--observation-window", type=non_negative_int, default=0,
                    help="observations: the turns ending at its evidence that each is stored and searched "
                         "after (default: 0; 1 is the turn it restates)")
    rt.add_argument("--observation-origin", action="store_true",
                    help="observations: the turn each restates is its origin (searched with it, not encoded)")
    data_options(rt, "retrieval")
    rt.set_defaults(func=cmd_retrieval)


def eval_retrieval_memories() -> tuple[str, ...]:
    from kvmem.bench.eval_retrieval import MEMORIES  # the CLI imports bench modules lazily

    return MEMORIES


def cmd_extract(args, config) -> int:
    from kvmem.bench import eval_extract
    from kvmem.service import KVMem

    # Flags left out keep ExtractEvalConfig's defaults (the tuning split, 8 turns per add).
    given = {k: getattr(args, k) for k in ("conversations", "turns_per_add") if getattr(args, k) is not None}
    cfg = eval_extract.ExtractEvalConfig(args.data, **given, threshold=args.threshold, sessions=args.sessions,
                                         workers=args.workers)
    # --extract-url reached config.extract through the overlay: then no engine is needed here.
    with KVMem(config, start_engine=not config.extract.url, background=False) as mem:
        # Extracted facts quote LoCoMo (CC BY-NC): the per-call log stays in the data folder.
        result = eval_extract.run(mem, cfg, config.home / "eval")
    print(eval_extract.report(result, args.out or RESULTS, cfg.name))
    return 0


def cmd_retrieval(args, config) -> int:
    from kvmem.bench import eval_retrieval
    from kvmem.service import KVMem

    with KVMem(config, start_engine=False, background=False) as mem:  # retrieval only: no engine
        result = eval_retrieval.run(mem, args.data, args.conversations, memory=args.memory, novel_only=args.novel,
                                    window=args.window, observation_window=args.observation_window,
                                    observation_origin=args.observation_origin)
    subset = "-" + "+".join(sorted(args.conversations)) if args.conversations else ""
    subset += eval_retrieval.memory_suffix(args.memory, args.window, args.observation_window, args.observation_origin)
    subset += "-novel" if args.novel else ""
    print(eval_retrieval.report(result, (args.out or RESULTS) / f"retrieval{subset}"))
    return 0


def cmd_locomo(args, config) -> int:
    from kvmem.bench import eval_locomo, eval_report

    # --text-facts reached config.kv.text_facts through the overlay (config_overlay.FLAGS).
    cfg = eval_locomo.EvalConfig(args.data, args.conversations, args.k, args.memory, args.window, args.limit or None,
                                 seed=args.seed, workers=args.workers, ranking=args.ranking, codecs=args.codecs,
                                 text_facts=config.kv.text_facts_setting, text_facts_rule=config.kv.text_facts_rule,
                                 observation_window=args.observation_window,
                                 observation_origin=args.observation_origin,
                                 recompute=config.kv.recompute_setting.tag, noise_floor=args.noise_floor,
                                 points=args.points)
    with open_service(config) as mem:
        # Per-question logs quote LoCoMo (CC BY-NC): they stay in the data folder, not in the repo.
        rows = eval_locomo.run(mem, cfg, config.home / "eval")
    print(eval_report.write(rows, cfg, args.out or RESULTS))
    return 0

