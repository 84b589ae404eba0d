"""`kvmem bench ttft|load|cache|cluster|oracle|codecs|ann` and `kvmem verify`: argument parsing and
report writing (`kvmem eval ...` is eval_cli.py's, with this module's option helpers).
(`kvmem bench reader` is kvmem.tune's: it measures with the tuning lab.)"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvmem.argtypes import non_negative_int, positive_int
from kvmem.bench import locomo

RESULTS = Path("docs/results")


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def add_parsers(sub) -> argparse._SubParsersAction:
    """`kvmem bench ...` and `kvmem eval ...`; -> the bench table, for benches declared elsewhere."""
    p = sub.add_parser("bench", help="measure TTFT and throughput, KV injection vs text prefill")
    bench = p.add_subparsers(dest="bench", required=True, metavar="BENCH")
    t = bench.add_parser("ttft", help="TTFT vs number of injected facts k")
    t.add_argument("--ks", type=_ints, default=(0, 5, 10, 25, 50, 100), help="comma-separated k values")
    t.add_argument("--reps", type=int, default=7, help="repetitions per k and mode (default: 7)")
    t.add_argument("--profile", action="store_true",
                   help="also print where KV mode's time goes per k: connector stages inside the engine, "
                        "retrieval and prompt assembly before it")
    t.add_argument("--points", type=point_list, default=(),
                   help="comma-separated fidelity points timed in the same repetitions, beside plain injection: "
                        "fast, balanced, exact, text-facts-N, or <rule>-<fraction> (e.g. first-0.15)")
    recompute_options(t)
    data_options(t, "ttft", synthetic=True)
    t.set_defaults(func=cmd_ttft)
    ld = bench.add_parser("load", help="throughput with concurrent users, k facts each")
    ld.add_argument("--users", type=_ints, default=(1, 4, 16, 32, 64), help="comma-separated concurrency levels")
    ld.add_argument("-k", type=int, default=50)
    ld.add_argument("--fact-zipf", type=float, default=0.0,
                    help="draw each chat's k facts by Zipf popularity with this exponent (default: 0, uniformly); "
                         "the RAM tier's hit rate shows")
    ld.add_argument("--pool", type=int, default=None,
                    help="facts per user to draw from (default: k + 20 uniformly, 4k with --fact-zipf)")
    ld.add_argument("--requests", type=int, default=4, help="requests per user per level and mode (default: 4)")
    ld.add_argument("--max-tokens", type=int, default=16)
    data_options(ld, "load", synthetic=True)
    ld.set_defaults(func=cmd_load)
    ca = bench.add_parser("cache", help="TTFT and disk hit rate under disk budgets, Zipf workload over many users")
    ca.add_argument("--users", type=int, default=40)
    ca.add_argument("--facts-per-user", type=int, default=10)
    ca.add_argument("-k", type=int, default=5, help="facts per chat (default: 5)")
    ca.add_argument("--zipf", type=float, default=1.0, help="skew over users and over each user's facts (default: 1.0)")
    ca.add_argument("--budgets", type=lambda s: tuple(float(x) for x in s.split(",") if x), default=(0.5, 0.2, 0.1),
                    help="disk budgets as shares of the working set, after the unlimited run (default: 0.5,0.2,0.1)")
    ca.add_argument("--warmup", type=int, default=100, help="untimed requests per budget (default: 100)")
    ca.add_argument("--timed", type=int, default=200, help="timed requests per budget (default: 200)")
    data_options(ca, "cache")
    ca.set_defaults(func=cmd_cache)
    g = bench.add_parser("gateway", help="kvmem serve vs a gateway in front of 1 and 2 replicas (real processes, "
                                         "PostgreSQL and Redis on loopback)")
    topology_options(g, 16, "concurrent users", "questions per user in the concurrent run")
    g.add_argument("--sequential", type=int, default=24, help="one-at-a-time requests for the hop cost (default: 24)")
    data_options(g, "gateway")
    g.set_defaults(func=cmd_gateway)
    ro = bench.add_parser("routing", help="rendezvous vs residency routing on two real replicas, every user's "
                                          "KV warm on replica 1 (as after replica 2 joined)")
    topology_options(ro, 12, "users, half per routing", "questions per user, in each phase")
    data_options(ro, "routing", synthetic=True)
    ro.set_defaults(func=cmd_routing)
    cl = bench.add_parser("cluster", help="simulated replicas routed by the real router: rendezvous vs residency, "
                                          "TTFT and resident-hit rate at several sizes, with replicas dying")
    # dest "sizes": a "replicas" dest would be read as the gateway's --replicas (engine.url) by the config overlay
    cl.add_argument("--replicas", dest="sizes", type=_ints, default=(2, 10, 100),
                    help="comma-separated cluster sizes (default: 2,10,100)")
    cl.add_argument("--deaths", type=float, default=0.1, help="share of replicas that die mid-run (default: 0.1)")
    cl.add_argument("--joins", type=float, default=0.0,
                    help="also a run where this share of new, empty replicas joins mid-run (default: 0, none)")
    cl.add_argument("--compute-speedup", type=float, default=1.0,
                    help="what-if: compute costs (k=0 TTFT, injection, decode) this many times faster, tier reads "
                         "as measured (default: 1, this host as measured)")
    cl.add_argument("--users-per-replica", type=positive_int, default=50)
    cl.add_argument("--facts-per-user", type=positive_int, default=100)
    cl.add_argument("-k", type=positive_int, default=50, help="facts per chat (default: 50)")
    cl.add_argument("--user-zipf", type=float, default=1.0, help="skew over users (default: 1.0)")
    cl.add_argument("--fact-zipf", type=float, default=1.0, help="skew over each user's facts (default: 1.0)")
    cl.add_argument("--rate", type=float, default=2.5, help="Poisson arrivals, chats/s per replica (default: 2.5)")
    cl.add_argument("--seconds", type=float, default=90.0, help="simulated seconds of arrivals (default: 90)")
    cl.add_argument("--warmup", type=float, default=30.0, help="untimed first seconds (default: 30)")
    cl.add_argument("--name", default="cluster", help="results file stem (default: cluster)")
    cl.add_argument("--out", type=Path, default=None, help=f"output folder (default: {RESULTS})")
    cl.add_argument("--seed", type=int, default=0)
    cl.set_defaults(func=cmd_cluster)
    o = bench.add_parser("oracle", help="injected KV vs text prefill of the same prompt (k=1 exact, k=10 approx.)")
    o.add_argument("--out", type=Path, default=None, help=f"output folder (default: {RESULTS})")
    o.set_defaults(func=cmd_oracle)
    v = sub.add_parser("verify", help="correctness gate for the model on this machine: injection oracles and "
                                      "fidelity vs text prefill; exit 1 on failure (chat mode auto reads it)")
    v.add_argument("--out", type=Path, default=None, help="also write the verdict to DIR/verify.json (it is "
                                                          "always cached under the home, per model fingerprint)")
    v.set_defaults(func=cmd_verify)
    cd = bench.add_parser("codecs", help="KV codecs side by side: bytes/token, k=1 gap, k=10 agreement and KL")
    cd.add_argument("--prompts", type=int, default=60, help="k=10 prompts per codec (default: 60)")
    cd.add_argument("--codecs", type=codec_list, default=None,
                    help="comma-separated codecs to compare (default: all; none is always run first)")
    data_options(cd, "codecs")
    cd.set_defaults(func=cmd_codecs)
    a = bench.add_parser("ann", help="graph index vs faiss HNSW / IVF-RaBitQ, hnswlib, exact scan "
                                     "(clustered data or LoCoMo embeddings)")
    a.add_argument("--data", choices=("clustered", "locomo"), default="clustered",
                   help="clustered synthetic vectors (default) or MiniLM embeddings of LoCoMo's turns/questions")
    a.add_argument("--locomo", type=Path, default=None, help="LoCoMo JSON for --data locomo (default: ../shared)")
    a.add_argument("--name", default=None, help="results file stem (default: ann, ann-<n> or ann-locomo)")
    a.add_argument("-n", type=int, default=100_000, help="base vectors (default: 100000; clustered only)")
    a.add_argument("--dim", type=int, default=384)
    a.add_argument("--queries", type=int, default=1_000)
    a.add_argument("--threads", type=int, default=2, help="build threads (search is 1 thread)")
    a.add_argument("--indexes", type=lambda s: tuple(x for x in s.split(",") if x), default=None,
                   help="comma-separated subset of kvmem-graph,faiss-hnsw,faiss-ivf-rabitq,hnswlib,exact")
    a.add_argument("--out", type=Path, default=None, help=f"output folder (default: {RESULTS})")
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds at recall 0.95 (default: 5)")
    a.add_argument("--no-filtered", dest="filtered", action="store_false",
                   help="skip the filtered GraphIndex timings (a second build of the data)")
    a.set_defaults(func=cmd_ann)

    from kvmem.bench import eval_cli  # its table reuses this module's option helpers

    eval_cli.add_parsers(sub)
    return bench


def topology_options(p, users: int, users_help: str, rounds_help: str) -> None:
    """The options of the benches that start real replicas and gateways (gateway, routing)."""
    p.add_argument("--users", type=int, default=users, help=f"{users_help} (default: {users})")
    p.add_argument("--facts-per-user", type=int, default=8)
    p.add_argument("-k", type=int, default=5, help="facts per chat (default: 5)")
    p.add_argument("--rounds", type=int, default=4, help=f"{rounds_help} (default: 4)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--workdir", type=Path, default=None,
                   help="where the processes keep their data (default: a fresh temporary folder)")


def data_options(p, name: str, *, synthetic: bool = False) -> None:
    """synthetic: --data left out reads the synthetic tuning set kvmem ships (results <name>-synthetic.*)."""
    if synthetic:
        p.add_argument("--data", type=Path, default=None,
                       help="LoCoMo JSON, read by path, never copied (default: the synthetic LoCoMo-shaped tuning "
                            "set kvmem ships, kvmem/tune/data/tuning_set.json, results named "
                            f"{name}-synthetic.*)")
    else:
        p.add_argument("--data", type=Path, default=locomo.DEFAULT_PATH,
                       help="LoCoMo JSON (read by path, never copied)")
    p.add_argument("--out", type=Path, default=None, help=f"output folder (default: {RESULTS})")
    p.add_argument("--seed", type=int, default=0)


def open_service(config, *, reader: bool = True):
    """reader=False: no reader adapter, for benches of injection itself (oracle, codecs)."""
    from dataclasses import replace

    from kvmem.service import KVMem

    if not reader:
        config = replace(config, kv=replace(config.kv, reader_adapter="off"))
    return KVMem(config, background=False)


def bench_data(args, name: str) -> tuple[Path, Path]:
    """(data file, results stem) of a bench whose --data defaults to the synthetic set, checked
    before the engine starts. Synthetic runs write <name>-synthetic.*, never over LoCoMo's results."""
    path, which = locomo.bench_data(args.data)
    print(locomo.describe_data(which, path), flush=True)
    return path, (args.out or RESULTS) / (name if which == locomo.LOCOMO else f"{name}-{which}")


def cmd_ttft(args, config) -> int:
    from kvmem.bench import ttft

    data, out = bench_data(args, "ttft")
    with open_service(config) as mem:
        result = ttft.run(mem, data=data, ks=args.ks, reps=args.reps, seed=args.seed, profile=args.profile,
                          points=args.points)
    print(ttft.report(result, out))
    return 0


def cmd_load(args, config) -> int:
    from kvmem.bench import load

    data, out = bench_data(args, "load")
    with open_service(config) as mem:
        result = load.run(mem, data=data, levels=args.users, k=args.k, requests=args.requests,
                          max_tokens=args.max_tokens, seed=args.seed, fact_zipf=args.fact_zipf, pool=args.pool)
    print(load.report(result, out))
    return 0


def cmd_gateway(args, config) -> int:
    import tempfile

    from kvmem.bench import gateway

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvmem-bench-gateway-"))
    result = gateway.run(data=args.data, workdir=workdir, models_home=config.models_dir, users=args.users,
                         facts_per_user=args.facts_per_user, k=args.k, rounds=args.rounds,
                         sequential=args.sequential, max_tokens=args.max_tokens, seed=args.seed)
    print(gateway.report(result, (args.out or RESULTS) / "gateway"))
    return 0


def cmd_routing(args, config) -> int:
    import tempfile

    from kvmem.bench import routing

    data, out = bench_data(args, "routing")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvmem-bench-routing-"))
    result = routing.run(data=data, workdir=workdir, models_home=config.models_dir, users=args.users,
                         facts_per_user=args.facts_per_user, k=args.k, rounds=args.rounds,
                         max_tokens=args.max_tokens, seed=args.seed)
    print(routing.report(result, out))
    return 0


def cmd_cluster(args, config) -> int:
    from kvmem.bench import cluster_report, cluster_sim

    base = cluster_sim.Scenario(users_per_replica=args.users_per_replica, facts_per_user=args.facts_per_user, k=args.k,
                                user_zipf=args.user_zipf, fact_zipf=args.fact_zipf, rate_per_replica=args.rate,
                                seconds=args.seconds, warmup_s=args.warmup, seed=args.seed)
    result = cluster_sim.run(replicas=args.sizes, deaths=args.deaths, joins=args.joins, base=base,
                             speedup=args.compute_speedup)
    print(cluster_report.report(result, (args.out or RESULTS) / args.name))
    return 0


def cmd_cache(args, config) -> int:
    from dataclasses import replace

    from kvmem.bench import cache
    from kvmem.service import KVMem

    with open_service(config) as owner:  # starts the engine; each budget reopens the service on it
        def open_mem(mib):
            budgeted = replace(config, kv=replace(config.kv, disk_budget_mib=mib))
            return KVMem(budgeted, engine=owner.engine, embedder=owner.embedder)

        result = cache.run(open_mem, data=args.data, users=args.users, facts_per_user=args.facts_per_user, k=args.k,
                           s=args.zipf, budgets=(None, *args.budgets), warmup=args.warmup, timed=args.timed,
                           seed=args.seed)
    print(cache.report(result, (args.out or RESULTS) / "cache"))
    return 0


def cmd_oracle(args, config) -> int:
    from kvmem.bench import oracle

    with open_service(config, reader=False) as mem:
        result = oracle.run(mem)
    print(oracle.report(result, (args.out or RESULTS) / "oracle"))
    return 0


def cmd_verify(args, config) -> int:
    from kvmem.bench import verify

    result = verify.check(config)
    print(verify.report(result, config.home, args.out))
    return 0 if result["passed"] else 1


def cmd_codecs(args, config) -> int:
    from kvmem.bench import codecs

    with open_service(config, reader=False) as mem:
        result = codecs.run(mem, data=args.data, prompts=args.prompts, seed=args.seed, codecs=args.codecs)
    print(codecs.report(result, (args.out or RESULTS) / "codecs"))
    return 0


def cmd_ann(args, config) -> int:
    from kvmem.bench import ann

    name = args.name or ("ann-locomo" if args.data == "locomo" else "ann" if args.n == 100_000 else f"ann-{args.n}")
    cfg = ann.AnnConfig(n=args.n, dim=args.dim, queries=args.queries, threads=args.threads, seed=args.seed,
                        centres=max(1, args.n // 100), data=args.data, locomo=str(args.locomo or ""), name=name,
                        rounds=args.rounds, filtered=args.filtered,
                        **({"indexes": args.indexes} if args.indexes else {}))
    print(ann.report(ann.run(cfg), args.out or RESULTS))
    return 0


def codec_list(text: str) -> tuple[str, ...]:
    """"int8,int6" -> ("int8", "int6"); none is the lossless reference, always there."""
    from kvmem.kv.codec import CODECS

    codecs = tuple(c.strip() for c in text.split(",") if c.strip() and c.strip() != "none")
    for codec in codecs:
        if codec not in CODECS:
            raise argparse.ArgumentTypeError(f"unknown KV codec {codec!r}; choose from {', '.join(CODECS)}")
    return codecs


def point_list(value: str) -> tuple[str, ...]:
    from kvmem.bench.ttft import fidelity_points as check

    names = tuple(v.strip() for v in value.split(",") if v.strip())
    try:
        check(names)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return names


def recompute_options(p) -> None:
    """--recompute / --recompute-rule, which reach config.kv through the overlay (config_overlay.FLAGS)."""
    from kvmem.kv.fidelity import POINTS
    from kvmem.kv.recompute import ENGINE_RULES

    p.add_argument("--recompute", type=float, default=None,
                   help="fraction of each fact's tokens recomputed at injection (default: the configured "
                        "kv.recompute, KVMEM_KV_RECOMPUTE, 0)")
    p.add_argument("--recompute-rule", choices=ENGINE_RULES, default=None,
                   help="which tokens are recomputed (default: the configured kv.recompute_rule, deviation)")
    p.add_argument("--fidelity", choices=tuple(POINTS), default=None,
                   help="a named point instead of --recompute/--recompute-rule/--text-facts: fast, balanced "
                        "or exact (kv.fidelity; docs/benchmarks.md, \"Fidelity points\")")
