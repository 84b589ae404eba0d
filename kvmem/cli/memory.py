"""`kvmem add | search | chat | forget | reembed`: a user's memory from the command line.

`add --no-encode`, `search`, `forget` and `reembed` never start the inference engine; `add` and
`chat` do; `search` does not even read the chat model (inspect_cmd.open_search). Every command
gets its Config from the overlay (kvmem.cli.main), never reads flags of its own into it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from kvmem.argtypes import non_negative_int, positive_int
from kvmem.config import Config
from kvmem.errors import InvalidInputError

# -- add --------------------------------------------------------------------------------------------


def cmd_add(args: argparse.Namespace, config: Config) -> int:
    """Store facts or a conversation; encode their KV now unless --no-encode."""
    from kvmem.service import KVMem

    _check_add(args)
    metadata = _json_arg("--metadata", args.metadata, dict)
    messages = _read_messages(args.messages) if args.messages is not None else None
    scope = {"user_id": args.user, "agent_id": args.agent, "run_id": args.run}
    encode = "none" if args.no_encode else "sync"
    if args.infer:
        return _add_inferred(args, config, messages, scope, metadata, encode)
    with KVMem(config, start_engine=not args.no_encode, background=False) as mem:
        started = time.time()
        if messages is not None:
            result = mem.add(messages, **scope, metadata=metadata, window=args.window, encode=encode)
        else:
            result = mem.add(facts=list(args.facts), **scope, metadata=metadata, timestamp=args.timestamp,
                             origin=args.origin or "", encode=encode)
        seen: set[str] = set()
        for fact_id in result.ids:
            record = mem.get(fact_id)
            new = fact_id not in seen and record.created_at >= started
            seen.add(fact_id)
            print(f"{fact_id}  {'new' if new else 'duplicate':9}  {record.text}")
        print(_add_summary(mem, result, args.no_encode))
    return 0


def _add_inferred(args: argparse.Namespace, config: Config, messages, scope: dict, metadata, encode: str) -> int:
    """--infer: the facts an LLM extracts from the conversation (or from the FACT arguments, read
    as the user's messages), reconciled with the stored ones; one line per fact and its event."""
    from kvmem.service import KVMem

    if args.no_encode and not config.extract.url:
        raise InvalidInputError("--infer --no-encode needs an extraction endpoint ([extract] url): without "
                                "one the served model extracts, and --no-encode starts no engine", param="--infer")
    if messages is None:
        messages = [{"role": "user", "content": fact} for fact in args.facts]
    with KVMem(config, start_engine=not args.no_encode, background=False) as mem:
        result = mem.add(messages, **scope, metadata=metadata, encode=encode, infer=True)
        for change in result.results:
            was = f"  (was: {change.previous_memory})" if change.previous_memory is not None else ""
            print(f"{change.id}  {change.event:9}  {change.memory}{was}")
        events = [c.event for c in result.results]
        counts = ", ".join(f"{events.count(e)} {e.lower()}" for e in ("ADD", "UPDATE", "DELETE", "NONE"))
        encoded = f"; encoded {result.encode.encoded} in {result.encode.seconds:.2f} s" if result.encode else ""
        print(f"{counts}{encoded}" if events else "no facts extracted")
        if result.stored_as_turns:
            print("the extraction LLM was unavailable: the messages were stored turn by turn "
                  "([extract] on_unavailable = turns)")
    return 0


def _check_add(args: argparse.Namespace) -> None:
    """Refuse flag combinations that do not go together, before anything is opened."""
    if bool(args.facts) == (args.messages is not None):
        raise InvalidInputError("give facts as arguments or --messages FILE.json, not both and not neither",
                                param="FACT")
    if args.infer and (args.timestamp is not None or args.origin is not None or args.window is not None):
        raise InvalidInputError("--infer extracts facts from the messages: --timestamp, --origin and --window "
                                "do not apply", param="--infer")
    if args.window is not None and args.messages is None:
        raise InvalidInputError("--window applies to --messages only", param="--window")
    if args.timestamp is not None and args.messages is not None:
        raise InvalidInputError("--timestamp applies to facts; messages carry their own", param="--timestamp")
    if args.origin is not None and args.messages is not None:
        raise InvalidInputError("--origin applies to facts; a conversation's turns are their own origin",
                                param="--origin")


def _add_summary(mem, result, no_encode: bool) -> str:
    summary = f"{result.created} created, {result.duplicates} duplicates"
    if no_encode:
        if result.created:
            summary += "; KV left pending (encoded the next time an engine starts: kvmem add or kvmem chat)"
        return summary
    if result.encode is not None:
        summary += f"; encoded {result.encode.encoded} in {result.encode.seconds:.2f} s"
        if result.encode.failed:
            summary += f", {len(result.encode.failed)} failed (served as text, retried in the background)"
    return summary + _encode_earlier_pending(mem)


def _encode_earlier_pending(mem) -> str:
    """Facts stored earlier with --no-encode get their KV now that an engine is up."""
    waiting = mem.encode_queue()
    if not waiting:
        return ""
    mem.encode_pending()
    return f"; also encoded {waiting} facts left pending earlier"


def _read_messages(path: str) -> list:
    source = "stdin" if path == "-" else path
    try:
        raw = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise InvalidInputError(f"cannot read --messages {source}: {e.strerror or e}", param="--messages") from e
    data = _json_arg("--messages", raw, (list, dict), label=f"--messages {source}")
    if isinstance(data, dict):  # {"messages": [...]} is accepted too
        if not isinstance(data.get("messages"), list):
            raise InvalidInputError(f"--messages {source}: expected a list of messages or {{\"messages\": [...]}}",
                                    param="--messages")
        data = data["messages"]
    return data


def _json_arg(flag: str, raw: str | None, kind, *, label: str | None = None):
    """The JSON value of flag's text, of the given type(s); label names it in messages."""
    if raw is None:
        return None
    name = label or flag
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as e:
        raise InvalidInputError(f"{name} is not valid JSON: {e}", param=flag) from e
    if not isinstance(value, kind):
        want = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise InvalidInputError(f"{name} must be a JSON {want.replace('dict', 'object').replace('list', 'array')}",
                                param=flag)
    return value


# -- search -----------------------------------------------------------------------------------------


def cmd_search(args: argparse.Namespace, config: Config) -> int:
    """The user's facts most similar to a query (no engine needed, nor the chat model)."""
    from kvmem.cli.inspect_cmd import open_search

    filters = _json_arg("--filters", args.filters, dict)
    with open_search(config) as retrieval:
        hits = retrieval.search(args.query, user_id=args.user, agent_id=args.agent, run_id=args.run, k=args.k,
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
        if waiting and args.mode in ("kv", "auto"):
            print(f"encoding {len(waiting)} facts left pending...", file=sys.stderr, flush=True)
            mem.encode_pending()
        if interactive:
            print(f"chatting as {args.user!r} ({args.mode} mode, k={args.k}); /quit or Ctrl-D ends", file=sys.stderr)
        messages: list[dict] = []
        for question in _questions(interactive):
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


def _questions(interactive: bool):
    """The questions read from stdin, one per line: empty lines skipped; /quit or EOF ends."""
    while True:
        if interactive:
            print("you> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line:  # EOF
            if interactive:
                print()
            return
        question = line.strip()
        if question == "/quit":
            return
        if question:
            yield question


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
                raise InvalidInputError(f"fact {r.id!r} does not belong to {_scope_name(args)}; nothing was forgotten",
                                        param="ID")
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


def _scope_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--user", required=True, help="whose memory (user id)")
    p.add_argument("--agent", help="narrow to one agent id")
    p.add_argument("--run", help="narrow to one run (session) id")


def add_parsers(sub) -> None:
    """add, search, chat, forget, reembed (an argparse table)."""
    p = sub.add_parser("add", help="store facts or a conversation for a user, and encode their KV",
                       description="Store facts (arguments) or a conversation (--messages, one fact per turn) "
                                   "for a user. Duplicates of stored facts are reported, not stored twice. "
                                   "Their KV is encoded now, unless --no-encode.")
    _scope_options(p)
    p.add_argument("facts", nargs="*", metavar="FACT", help="fact texts, one per argument")
    p.add_argument("--messages", metavar="FILE.json",
                   help="a JSON list of {role, content, timestamp?, name?} messages; '-' reads stdin")
    p.add_argument("--metadata", metavar="JSON", help="a JSON object stored with every fact")
    p.add_argument("--window", type=non_negative_int, metavar="N",
                   help="with --messages: turns of context each turn is encoded after (default: 2)")
    p.add_argument("--timestamp", metavar="WHEN",
                   help="with facts: when they held, shown before each ('2023-05-09' reads as '9 May 2023')")
    p.add_argument("--origin", metavar="TEXT",
                   help="with facts: the message they were drawn from; they are searched with it, never encoded after it")
    p.add_argument("--no-encode", action="store_true",
                   help="store and index only, without starting the engine; KV is encoded the next time one starts")
    p.add_argument("--infer", action="store_true",
                   help="an LLM extracts facts from the messages (FACT arguments: user messages) and "
                        "reconciles them with the stored ones: ADD, UPDATE, DELETE (Mem0's infer)")
    p.set_defaults(func=cmd_add)

    p = sub.add_parser("search", help="list a user's facts most similar to a query (no engine)",
                       description="Rank a user's facts by similarity to QUERY. Needs no engine.")
    _scope_options(p)
    p.add_argument("query", metavar="QUERY")
    p.add_argument("-k", type=positive_int, default=5, help="how many facts (default: 5)")
    p.add_argument("--filters", metavar="JSON", help='metadata filters as a JSON object, e.g. \'{"topic": "pets"}\'')
    p.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")
    p.set_defaults(func=cmd_search)

    p = sub.add_parser("chat", help="chat with the model, the user's retrieved facts injected as KV",
                       description="Read one question per line from stdin and answer it with the user's top-k "
                                   "facts in the prompt (as KV in kv mode, as text in text mode, none in off "
                                   "mode). The conversation so far is kept. An empty line is ignored; /quit or "
                                   "end of input ends the chat.")
    _scope_options(p)
    p.add_argument("--mode", choices=("kv", "text", "off", "auto"), default="kv",
                   help="how facts reach the model: KV injection, text prefill, none, or auto: kv where "
                        "`kvmem verify` passed for this model, else text (default: kv)")
    p.add_argument("-k", type=positive_int, default=5, help="facts retrieved per question (default: 5)")
    p.add_argument("--max-tokens", type=positive_int, default=128, help="answer length limit (default: 128)")
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
    p.add_argument("--batch", type=positive_int, default=256, help="facts embedded per call (default: 256)")
    p.set_defaults(func=cmd_reembed)
