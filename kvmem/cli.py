"""kvmem command line: store, search, chat with and forget a user's memory; `kvmem demo` shows it all.

Memory lives in the data folder (--home, default $KVMEM_HOME or ~/.cache/kvmem). `add --no-encode`,
`search` and `forget` never start the inference engine; `add`, `chat` and `demo` do (vLLM, about a
minute on a CPU host).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

from kvmem.config import Config, default_home
from kvmem.errors import InvalidInputError, KvmemError

# -- demo -----------------------------------------------------------------------------------------

DEMO_USER = "demo-user"
DEMO_CONVERSATION = [
    {"role": "user", "content": "Hi! I moved to Porto last month for a new job."},
    {"role": "assistant", "content": "Welcome to Porto! What kind of job brought you there?"},
    {"role": "user", "content": "I am a software engineer at a company that builds signalling systems for trams."},
    {"role": "assistant", "content": "That sounds interesting. Did you move on your own?"},
    {"role": "user", "content": "No, my dog Pepper came with me. She is a three-year-old border collie."},
    {"role": "assistant", "content": "Border collies need a lot of exercise. Does Pepper like the city?"},
    {"role": "user", "content": "She loves the beach at Matosinhos, where we go running every morning."},
    {"role": "assistant", "content": "What a great routine. Do you have family nearby?"},
    {"role": "user", "content": "My sister Marta lives in Braga, an hour away. She teaches the violin."},
    {"role": "assistant", "content": "How lovely. What do you do to relax at the weekend?"},
    {"role": "user", "content": "I paint watercolours of old buildings and sell some at a local market."},
    {"role": "assistant", "content": "Porto's tiled facades must be perfect subjects for that."},
]
DEMO_QUESTIONS = [
    "What is my dog's name?",
    "What does my sister teach?",
    "What do I paint at the weekend?",
]


def cmd_demo(args: argparse.Namespace, config: Config) -> int:
    """Store a short conversation, then ask three questions in text and KV mode with retrieval (k=4)."""
    from kvmem.service import KVMem

    print("kvmem demo: starting vLLM with the kvmem connector (the first run converts the model)...", flush=True)
    with KVMem(config, background=False) as mem:
        mem.delete_all(user_id=DEMO_USER)  # reruns start from the same empty memory
        added = mem.add(DEMO_CONVERSATION, user_id=DEMO_USER, window=2)
        report = added.encode
        per_token = mem.model.kv_bytes_per_token(config.kv.codec)
        print(f"\nmodel {mem.model.path.name} ({mem.model.num_layers} layers, {mem.model.num_kv_heads} KV heads x "
              f"{mem.model.head_size}); KV {per_token:,} bytes/token; encoded {report.encoded} facts "
              f"({len(DEMO_CONVERSATION)} turns, window 2) in {report.seconds:.2f} s")
        adapter = mem.engine.reader_adapter
        print(f"KV mode reads with the reader adapter {adapter}" if adapter else "KV mode without a reader adapter")
        for mode in ("text", "kv"):  # warm-up, not timed: a fresh engine's first requests pay one-off costs
            mem.chat("Hello!", user_id=DEMO_USER, k=4, mode=mode, max_tokens=1)
        for question in DEMO_QUESTIONS:
            text = mem.chat(question, user_id=DEMO_USER, k=4, mode="text", max_tokens=48)
            kv = mem.chat(question, user_id=DEMO_USER, k=4, mode="kv", max_tokens=48)
            print(f"\nQ: {question}   ({kv.prompt_tokens} prompt tokens, {len(kv.fact_ids)} facts retrieved)")
            for i, fact_id in enumerate(kv.fact_ids, 1):
                print(f"  {i}. {mem.get(fact_id).text}")
            cached = f", {text.cached_tokens} from vLLM's prefix cache" if text.cached_tokens else ""
            print(f"  text  TTFT {text.ttft_s * 1000:7.1f} ms | {_one_line(text.answer)}")
            print(f"  kv    TTFT {kv.ttft_s * 1000:7.1f} ms | {_one_line(kv.answer)}")
            print(f"        TTFT text/kv = {text.ttft_s / kv.ttft_s:.1f}x; {kv.injected_tokens} tokens injected, "
                  f"{kv.fallbacks} fallbacks (text mode: {text.prompt_tokens} prompt tokens{cached})")
    return 0


def _one_line(text: str) -> str:
    return " ".join(text.split())


# -- add --------------------------------------------------------------------------------------------


def cmd_add(args: argparse.Namespace, config: Config) -> int:
    """Store facts or a conversation; encode their KV now unless --no-encode."""
    from kvmem.service import KVMem

    if bool(args.facts) == (args.messages is not None):
        raise InvalidInputError("give facts as arguments or --messages FILE.json, not both and not neither")
    if args.window is not None and args.messages is None:
        raise InvalidInputError("--window applies to --messages only")
    if args.timestamp is not None and args.messages is not None:
        raise InvalidInputError("--timestamp applies to facts; messages carry their own")
    if args.origin is not None and args.messages is not None:
        raise InvalidInputError("--origin applies to facts; a conversation's turns are their own origin")
    metadata = _json_arg("--metadata", args.metadata, dict)
    messages = _read_messages(args.messages) if args.messages is not None else None
    scope = {"user_id": args.user, "agent_id": args.agent, "run_id": args.run}
    with KVMem(config, start_engine=not args.no_encode, background=False) as mem:
        started = time.time()
        if messages is not None:
            result = mem.add(messages, **scope, metadata=metadata, window=args.window,
                             encode="none" if args.no_encode else "sync")
        else:
            result = mem.add(facts=list(args.facts), **scope, metadata=metadata, timestamp=args.timestamp,
                             origin=args.origin or "", encode="none" if args.no_encode else "sync")
        seen: set[str] = set()
        for fact_id in result.ids:
            record = mem.get(fact_id)
            new = fact_id not in seen and record.created_at >= started
            seen.add(fact_id)
            print(f"{fact_id}  {'new' if new else 'duplicate':9}  {record.text}")
        summary = f"{result.created} created, {result.duplicates} duplicates"
        if args.no_encode:
            if result.created:
                summary += "; KV left pending (encoded the next time an engine starts: kvmem add or kvmem chat)"
        elif result.encode is not None:
            summary += f"; encoded {result.encode.encoded} in {result.encode.seconds:.2f} s"
            if result.encode.failed:
                summary += f", {len(result.encode.failed)} failed (served as text, retried in the background)"
        summary += _encode_earlier_pending(mem) if not args.no_encode else ""
        print(summary)
    return 0


def _encode_earlier_pending(mem) -> str:
    """Facts stored earlier with --no-encode get their KV now that an engine is up."""
    from kvmem.facts.store import MAX_LIMIT

    waiting = len(mem.facts.pending(limit=MAX_LIMIT, max_attempts=mem.encoder.max_attempts))
    if not waiting:
        return ""
    mem.encoder.start()
    mem.encode_pending()
    return f"; also encoded {waiting} facts left pending earlier"


def _read_messages(path: str) -> list:
    source = "stdin" if path == "-" else path
    try:
        raw = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise InvalidInputError(f"cannot read --messages {source}: {e.strerror or e}") from e
    data = _json_arg(f"--messages {source}", raw, (list, dict))
    if isinstance(data, dict):  # {"messages": [...]} is accepted too
        if not isinstance(data.get("messages"), list):
            raise InvalidInputError(f"--messages {source}: expected a list of messages or {{\"messages\": [...]}}")
        data = data["messages"]
    return data


def _json_arg(name: str, raw: str | None, kind):
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as e:
        raise InvalidInputError(f"{name} is not valid JSON: {e}") from e
    if not isinstance(value, kind):
        want = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise InvalidInputError(f"{name} must be a JSON {want.replace('dict', 'object').replace('list', 'array')}")
    return value


# -- search -----------------------------------------------------------------------------------------


def cmd_search(args: argparse.Namespace, config: Config) -> int:
    """The user's facts most similar to a query (no engine needed)."""
    from kvmem.service import KVMem

    filters = _json_arg("--filters", args.filters, dict)
    with KVMem(config, start_engine=False, background=False) as mem:
        hits = mem.search(args.query, user_id=args.user, agent_id=args.agent, run_id=args.run, k=args.k,
                          filters=filters)
    if args.json:
        for rank, h in enumerate(hits, 1):
            print(json.dumps({"rank": rank, "id": h.id, "score": round(h.score, 6), "text": h.text,
                              "kv_status": h.kv_status, "metadata": h.metadata, "created_at": h.created_at},
                             ensure_ascii=False))
        return 0
    if not hits:
        print("no matching facts")
        return 0
    id_width = max(len(h.id) for h in hits)
    print(f"{'rank':>4}  {'score':>6}  {'kv':8}  {'id':{id_width}}  text")
    for rank, h in enumerate(hits, 1):
        print(f"{rank:>4}  {h.score:6.3f}  {h.kv_status:8}  {h.id:{id_width}}  {h.text}")
    return 0


# -- chat -------------------------------------------------------------------------------------------


def cmd_chat(args: argparse.Namespace, config: Config) -> int:
    """Talk to the model with the user's memory: one question per line on stdin; /quit or EOF ends."""
    from kvmem.facts.store import MAX_LIMIT
    from kvmem.service import KVMem

    interactive = sys.stdin.isatty()
    dim = (lambda s: f"\033[2m{s}\033[0m") if sys.stdout.isatty() else (lambda s: s)
    scope = {"user_id": args.user, "agent_id": args.agent, "run_id": args.run}
    with KVMem(config, background=True) as mem:
        waiting = [f for f in mem.get_all(**scope, limit=MAX_LIMIT) if f.kv_status != "encoded"]
        if waiting and args.mode == "kv":
            print(f"encoding {len(waiting)} facts left pending...", file=sys.stderr, flush=True)
            mem.encode_pending()
        if interactive:
            print(f"chatting as {args.user!r} ({args.mode} mode, k={args.k}); /quit or Ctrl-D ends", file=sys.stderr)
        messages: list[dict] = []
        while True:
            if interactive:
                print("you> ", end="", flush=True)
            line = sys.stdin.readline()
            if not line:  # EOF
                if interactive:
                    print()
                break
            question = line.strip()
            if not question:
                continue
            if question == "/quit":
                break
            turn = [*messages, {"role": "user", "content": question}]
            try:
                r = mem.chat(turn, **scope, k=args.k, mode=args.mode, max_tokens=args.max_tokens)
            except InvalidInputError as e:  # e.g. the conversation outgrew the context: say so, keep going
                print(f"kvmem: {e}", file=sys.stderr)
                continue
            messages = [*turn, {"role": "assistant", "content": r.answer}]
            print(f"assistant> {r.answer}")
            print(dim(_chat_details(mem, r)), flush=True)
    return 0


def _chat_details(mem, r) -> str:
    from kvmem.errors import UnknownFactError

    facts = []
    for i, fact_id in enumerate(r.fact_ids, 1):
        try:
            facts.append(f"[{i}] {mem.get(fact_id).text}")
        except UnknownFactError:  # forgotten meanwhile
            facts.append(f"[{i}] ({fact_id} forgotten)")
    shown = "  ".join(facts) if facts else "(no facts)"
    return (f"  facts: {shown} | TTFT {r.ttft_s * 1000:.1f} ms, {r.injected_tokens} tokens injected, "
            f"{r.fallbacks} fallbacks")


# -- forget -----------------------------------------------------------------------------------------


def cmd_forget(args: argparse.Namespace, config: Config) -> int:
    """Delete facts by id, or a user's (agent's, run's) whole memory with --all (no engine needed)."""
    from kvmem.service import KVMem

    with KVMem(config, start_engine=False, background=False) as mem:
        if args.all:
            n = mem.delete_all(user_id=args.user, agent_id=args.agent, run_id=args.run)
            print(f"forgot {n} facts of {_scope_name(args)}")
            return 0
        records = [mem.get(fact_id) for fact_id in dict.fromkeys(args.ids)]  # unknown ids fail here, before any delete
        for r in records:
            if (r.user_id != args.user or (args.agent is not None and r.agent_id != args.agent)
                    or (args.run is not None and r.run_id != args.run)):
                raise InvalidInputError(f"fact {r.id!r} does not belong to {_scope_name(args)}; nothing was forgotten")
        for r in records:
            mem.delete(r.id)
            print(f"forgot {r.id}  {r.text}")
    return 0


def _scope_name(args: argparse.Namespace) -> str:
    name = f"user {args.user!r}"
    if args.agent is not None:
        name += f", agent {args.agent!r}"
    if args.run is not None:
        name += f", run {args.run!r}"
    return name


# -- reembed ----------------------------------------------------------------------------------------


def cmd_reembed(args: argparse.Namespace, config: Config) -> int:
    """Recompute stored facts' search vectors with the current recipe (no engine needed)."""
    from kvmem.service import KVMem

    with KVMem(config, start_engine=False, background=False) as mem:
        n = mem.reembed(user_id=args.user, batch=args.batch, progress=True)
    print(f"re-embedded {n} facts" + (f" of user {args.user!r}" if args.user else ""))
    return 0


# -- parsing ----------------------------------------------------------------------------------------


def cmd_replica(args: argparse.Namespace, config: Config) -> int:
    import shlex

    from kvmem.engine import replica
    from kvmem.model import resolve_model

    if args.kv_shared_url:
        config = replace(config, kv=replace(config.kv, shared_url=args.kv_shared_url))
    model = resolve_model(config.engine.model, config.models_dir, config.engine.dtype)
    cmd = replica.command(config, model, host=args.host, port=args.port)
    env = replica.environment(config)
    if args.print:
        print(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(cmd))
        return 0
    os.execve(cmd[0], cmd, {**os.environ, **env})  # the replica is vLLM's process from here on


def _positive_int(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def _non_negative_int(value: str) -> int:
    n = int(value)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {n}")
    return n


def _scope_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--user", required=True, help="whose memory (user id)")
    p.add_argument("--agent", help="narrow to one agent id")
    p.add_argument("--run", help="narrow to one run (session) id")


def build_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False: else chat's --mode would be read as an ambiguous prefix of --model/--models-home.
    parser = argparse.ArgumentParser(prog="kvmem", description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--home", type=Path,
                        help="data folder: facts and KV blobs (default: $KVMEM_HOME or ~/.cache/kvmem)")
    parser.add_argument("--models-home", type=Path,
                        help=f"where converted models are kept (default: {default_home() / 'models'})")
    parser.add_argument("--model", help="a bundled model (smollm2-135m, gemma3-270m), a local HF model folder "
                                        "or a hub id (default: bundled SmolLM2-135M)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress (INFO)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("add", help="store facts or a conversation for a user, and encode their KV",
                       description="Store facts (arguments) or a conversation (--messages, one fact per turn) "
                                   "for a user. Duplicates of stored facts are reported, not stored twice. "
                                   "Their KV is encoded now, unless --no-encode.")
    _scope_options(p)
    p.add_argument("facts", nargs="*", metavar="FACT", help="fact texts, one per argument")
    p.add_argument("--messages", metavar="FILE.json",
                   help="a JSON list of {role, content, timestamp?, name?} messages; '-' reads stdin")
    p.add_argument("--metadata", metavar="JSON", help="a JSON object stored with every fact")
    p.add_argument("--window", type=_non_negative_int, metavar="N",
                   help="with --messages: turns of context each turn is encoded after (default: 2)")
    p.add_argument("--timestamp", metavar="WHEN",
                   help="with facts: when they held, shown before each ('2023-05-09' reads as '9 May 2023')")
    p.add_argument("--origin", metavar="TEXT",
                   help="with facts: the message they were drawn from; they are searched with it, never encoded after it")
    p.add_argument("--no-encode", action="store_true",
                   help="store and index only, without starting the engine; KV is encoded the next time one starts")
    p.set_defaults(func=cmd_add)

    p = sub.add_parser("search", help="list a user's facts most similar to a query (no engine)",
                       description="Rank a user's facts by similarity to QUERY. Needs no engine.")
    _scope_options(p)
    p.add_argument("query", metavar="QUERY")
    p.add_argument("-k", type=_positive_int, default=5, help="how many facts (default: 5)")
    p.add_argument("--filters", metavar="JSON", help='metadata filters as a JSON object, e.g. \'{"topic": "pets"}\'')
    p.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")
    p.set_defaults(func=cmd_search)

    p = sub.add_parser("chat", help="chat with the model, the user's retrieved facts injected as KV",
                       description="Read one question per line from stdin and answer it with the user's top-k "
                                   "facts in the prompt (as KV in kv mode, as text in text mode, none in off "
                                   "mode). The conversation so far is kept. An empty line is ignored; /quit or "
                                   "end of input ends the chat.")
    _scope_options(p)
    p.add_argument("--mode", choices=("kv", "text", "off"), default="kv",
                   help="how facts reach the model: KV injection, text prefill, or none (default: kv)")
    p.add_argument("-k", type=_positive_int, default=5, help="facts retrieved per question (default: 5)")
    p.add_argument("--max-tokens", type=_positive_int, default=128, help="answer length limit (default: 128)")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("forget", help="delete facts by id, or all of a user's facts (no engine)",
                       description="Delete facts: their text, vector and KV blob. Each ID must belong to the "
                                   "user (and agent/run, where given); --all deletes the whole scope.")
    _scope_options(p)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("ids", nargs="*", default=[], metavar="ID", help="fact ids to delete")
    what.add_argument("--all", action="store_true", help="delete every fact of the user (narrowed by --agent/--run)")
    p.set_defaults(func=cmd_forget)

    p = sub.add_parser("reembed", help="recompute the search vectors of stored facts (no engine)",
                       description="Re-embed every stored fact (or one user's) the way `add` embeds it now, and "
                                   "re-index it: for a home written by an older kvmem. "
                                   "Safe to interrupt and rerun.")
    p.add_argument("--user", default=None, help="only this user's facts (default: every user's)")
    p.add_argument("--batch", type=_positive_int, default=256, help="facts embedded per call (default: 256)")
    p.set_defaults(func=cmd_reembed)

    p = sub.add_parser("demo", help="store a short conversation, ask three questions in text and KV mode",
                       description="Store a 12-turn conversation for a demo user, then ask three questions "
                                   "in text and KV mode with k=4 retrieved facts, timing both.")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("replica", help="run vLLM's stock OpenAI server with kvmem's connector (a replica)",
                       description="Start vLLM's own OpenAI-compatible server with kvmem's KV connector, reading "
                                   "and writing blobs in this home's KV folder (and the shared Redis tier, "
                                   "when given). `kvmem gateway --replicas http://HOST:PORT` (or `kvmem serve` "
                                   "with KVMEM_ENGINE_URL) then sends its requests there instead of starting "
                                   "vLLM itself.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=_positive_int, default=8000, help="port (default: 8000)")
    p.add_argument("--kv-shared-url", help="Redis URL of the shared KV tier (KVMEM_KV_SHARED_URL): blobs this "
                                           "replica lacks are pulled from there, and those it encodes stored there")
    p.add_argument("--print", action="store_true", help="print the command and environment, do not start it")
    p.set_defaults(func=cmd_replica)

    sub.add_parser("serve", add_help=False,
                   help="HTTP server: OpenAI-compatible chat with memory and a Mem0-shaped memory API "
                        "(kvmem serve --help)")
    sub.add_parser("gateway", add_help=False,
                   help="the same HTTP server with no engine inside: sends prompts to replicas, facts in "
                        "PostgreSQL, blobs in a shared Redis tier (kvmem gateway --help)")
    from kvmem.bench import cli as bench_cli
    from kvmem.tune import cli as reader_cli

    bench_cli.add_parsers(sub)
    reader_cli.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["serve"], ["gateway"]):  # the server parses its own flags: kvmem serve --help
        from kvmem.server.cli import serve_main

        return serve_main(argv[1:], gateway=argv[0] == "gateway")
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "forget" and not args.all and not args.ids:
        parser.error("forget: give fact ids or --all")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # "Loading weights" bars on every command; kvmem's own bars stay
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # read when vLLM is imported; -v keeps its INFO lines
    config = Config.from_env()
    config = replace(config, models_home=args.models_home or default_home() / "models")
    if args.home:
        config = replace(config, home=args.home)
    if args.model:
        config = replace(config, engine=replace(config.engine, model=args.model))
    try:
        return args.func(args, config)
    except KvmemError as e:
        print(f"kvmem: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
