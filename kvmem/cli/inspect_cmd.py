"""`kvmem list | get | history | update | stats`: an operator's look at a home's memory.

None of them starts the engine, and all but `update` read the fact store alone: no model is
resolved (so none is ever converted), no tokenizer or embedder is loaded, so they answer in
about the time Python takes to start. `update` opens the service without an engine: it
re-embeds the new text and checks it against the model's tokenizer (as `add` does), and leaves
its KV pending for the next engine to encode. `search` (memory.py) opens `open_search`'s
retrieval alone, for the same reason.
"""

from __future__ import annotations

import argparse
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any

from kvmem.argtypes import non_negative_int, positive_int
from kvmem.cli.memory import _json_arg
from kvmem.config import Config
from kvmem.errors import InvalidInputError, KvmemError, UnknownFactError

ENCODE_LATER = "its KV is pending: encoded the next time an engine starts (kvmem serve, chat or add)"


# -- opening a home without the model ---------------------------------------------------------------


def open_store(config: Config, *, create: bool = False):
    """The home's fact store. A SQLite home that does not exist is refused unless `create`: a
    mistyped --home must not answer "no facts" (nor leave an empty home behind)."""
    from kvmem.facts import open_fact_store

    path = config.home / "facts.sqlite"
    if config.database_url is None and not create and not path.is_file():
        raise KvmemError(f"no kvmem home at {config.home} (it has no facts.sqlite); check --home")
    return open_fact_store(config.database_url, path)


@contextmanager
def open_search(config: Config) -> Iterator[Any]:
    """The home's retrieval (indexes built from the store, the embedder loaded on the first
    query) without the service: no model resolved, no KV store opened. The query is embedded in
    NumPy (the same vectors to float32 rounding): a cold process spends no 2 s loading torch."""
    from kvmem.embed.numpy_minilm import NumpyMiniLMEmbedder
    from kvmem.retrieval import Retrieval

    with open_store(config, create=True) as store:
        retrieval = Retrieval(store, NumpyMiniLMEmbedder(), config.retrieval, threading.RLock())
        try:
            yield retrieval
        finally:
            retrieval.close()


def when(seconds: float) -> str:
    """A stored time for people: UTC, to the second."""
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


def one_line(text: str) -> str:
    return text.replace("\r\n", "\n").replace("\n", " \u23ce ")


def blob_bytes(config: Config) -> dict[str, int]:
    """fact id -> bytes of its KV blob files on this disk (every model's folder): the KV store
    itself would need the model's fingerprint, so the files are read by name instead."""
    sizes: dict[str, int] = {}
    if config.kv_dir.is_dir():
        for path in config.kv_dir.glob("*/*.safetensors"):
            fact_id = path.name[: -len(".safetensors")]
            sizes[fact_id] = sizes.get(fact_id, 0) + path.stat().st_size
    return sizes


def _fact_json(record, kv_bytes: int | None = None) -> dict[str, Any]:
    """A record as JSON: every field but its vector (and the store's keys); its blob's bytes if given."""
    fields = {k: v for k, v in record.__dict__.items() if k not in ("embedding", "content_hash", "scope_key")}
    return fields if kv_bytes is None else {**fields, "kv_blob_bytes": kv_bytes}


# -- list -------------------------------------------------------------------------------------------


def cmd_list(args: argparse.Namespace, config: Config) -> int:
    """A page of stored facts, oldest first: one user's (narrowed by agent, run, metadata) or all."""
    from kvmem.facts.text import check_nested
    from kvmem.index import matcher

    if args.user is None and (args.agent or args.run):
        raise InvalidInputError("--agent and --run narrow a --user", param="--user")
    filters = _json_object("--filters", args.filters)
    check_nested("--filters", filters)
    where = matcher(filters) if filters else None  # checked and compiled once, tested on each fact
    with open_store(config) as store:
        records = store.list(user_id=args.user, agent_id=args.agent, run_id=args.run, limit=args.limit,
                             offset=args.offset, where=where)
        total = None if filters else store.count(args.user, args.agent, args.run)
    if args.json:
        for r in records:
            print(json.dumps(_fact_json(r), ensure_ascii=False))
        return 0
    if not records:
        print("no facts" + (" on this page" if args.offset else ""))
        return 0
    width = max(len(r.id) for r in records)
    users = max(len("user"), *(len(r.user_id) for r in records)) if args.user is None else None
    print(f"{'id':{width}}  " + (f"{'user':{users}}  " if users else "") + f"{'kv':8}  {'created':20}  text")
    for r in records:
        print(f"{r.id:{width}}  " + (f"{r.user_id:{users}}  " if users else "") +
              f"{r.kv_status:8}  {when(r.created_at):20}  {one_line(r.text)}")
    shown = f"facts {args.offset + 1}-{args.offset + len(records)}" + (f" of {total}" if total is not None else "")
    more = len(records) == args.limit and (total is None or args.offset + len(records) < total)
    print(shown + (f"; --offset {args.offset + len(records)} for more" if more else ""))
    return 0


def _json_object(flag: str, raw: str | None) -> dict | None:
    return _json_arg(flag, raw, dict)


# -- get, history -----------------------------------------------------------------------------------


def cmd_get(args: argparse.Namespace, config: Config) -> int:
    """Every field of each fact (but its vector), and the bytes of its KV blob on disk."""
    sizes = blob_bytes(config)
    with open_store(config) as store:
        records = [_get(store, fact_id) for fact_id in args.ids]  # an unknown id fails before any output
    for i, r in enumerate(records):
        if args.json:
            print(json.dumps(_fact_json(r, sizes.get(r.id, 0)), ensure_ascii=False))
            continue
        print(("\n" if i else "") + _describe(r, sizes.get(r.id, 0)))
    return 0


def _get(store, fact_id: str):
    """The fact, or an error that says when it was deleted, when it was."""
    try:
        return store.get(fact_id)
    except UnknownFactError:
        try:
            events = store.history(fact_id)
        except UnknownFactError:
            raise UnknownFactError(fact_id) from None
        raise KvmemError(f"fact {fact_id!r} was deleted on {when(events[-1].at)}; "
                         f"`kvmem history {fact_id}` shows what happened to it") from None


def _describe(r, kv_bytes: int) -> str:
    scope = r.user_id + (f", agent {r.agent_id}" if r.agent_id else "") + (f", run {r.run_id}" if r.run_id else "")
    turn = (f" (turn {r.position}" + (f" of {r.conversation_id}" if r.conversation_id else "") + ")"
            if r.position is not None else "")
    rows = [("id", r.id), ("user", scope), ("text", r.text),
            ("metadata", json.dumps(r.metadata, ensure_ascii=False)), ("origin", r.origin or "-"),
            ("context", r.context or "-"), ("source", r.source + turn),
            ("event time", r.event_time or "-"), ("created", when(r.created_at)), ("updated", when(r.updated_at)),
            ("expires", when(r.expires_at) if r.expires_at is not None else "never"),
            ("kv", f"{r.kv_status} (attempts {r.kv_attempts}); blob on disk: {kv_bytes:,} bytes"),
            ("vector", f"{r.embedding_dim} floats" if r.embedding_dim else "none (kvmem reembed makes it)")]
    return "\n".join(f"{name:10}  {value}" for name, value in rows)


def cmd_history(args: argparse.Namespace, config: Config) -> int:
    """A fact's events, oldest first, also after it was deleted (its words scrubbed then)."""
    with open_store(config) as store:
        events = store.history(args.id)
    if args.json:
        for e in events:
            print(json.dumps(e.__dict__, ensure_ascii=False))
        return 0
    for e in events:
        if e.event == "DELETE":
            change = ""
        elif e.old_text is None and e.new_text is None:  # scrubbed by the delete
            change = "(text forgotten)"
        elif e.event == "ADD":
            change = one_line(e.new_text or "")
        else:
            change = f"{one_line(e.old_text or '')}  ->  {one_line(e.new_text or '')}"
        print(f"{when(e.at)}  {e.event:6}  {change}".rstrip())
    return 0


# -- update -----------------------------------------------------------------------------------------


def cmd_update(args: argparse.Namespace, config: Config) -> int:
    """New text and/or metadata for a fact: re-embedded and re-indexed now, its KV re-encoded later."""
    from kvmem.service import KVMem

    metadata = _json_object("--metadata", args.metadata)
    if args.text is None and metadata is None:
        raise InvalidInputError("give the new TEXT, --metadata JSON, or both", param="TEXT")
    open_store(config).close()  # refuses a missing home before the service opens one
    with KVMem(config, start_engine=False, background=False) as mem:
        old = _get(mem.facts, args.id)
        new = mem.update(args.id, old.text if args.text is None else args.text, metadata)
    if new.text != old.text:
        print(f"updated {new.id}  {new.text}\n{ENCODE_LATER}")
    elif new.metadata != old.metadata:
        print(f"updated the metadata of {new.id}: {json.dumps(new.metadata, ensure_ascii=False)}")
    else:
        print(f"{new.id} already says that; nothing changed")
    return 0


# -- stats ------------------------------------------------------------------------------------------


def cmd_stats(args: argparse.Namespace, config: Config) -> int:
    """Facts by KV status, users and scopes, vectors, history, deleted facts, KV blobs on disk."""
    from kvmem.facts.store import MAX_LIMIT

    sizes = blob_bytes(config)
    with open_store(config) as store:
        numbers = store.tally(user_id=args.user, top=args.top)
        if args.user is not None:  # only this user's blobs
            ids, offset = set(), 0
            while page := store.list(user_id=args.user, limit=MAX_LIMIT, offset=offset):
                ids.update(r.id for r in page)
                offset += len(page)
            sizes = {k: v for k, v in sizes.items() if k in ids}
    where = str(config.home / "facts.sqlite") if config.database_url is None else "PostgreSQL (database_url)"
    numbers = {"store": where, **numbers, "kv_blobs": len(sizes), "kv_bytes": sum(sizes.values())}
    if args.json:
        print(json.dumps(numbers, ensure_ascii=False))
        return 0
    status = ", ".join(f"{k} {v}" for k, v in numbers["kv_status"].items())
    rows = [("store", where), ("facts", f"{numbers['facts']} ({status})"),
            ("users", f"{numbers['users']} ({numbers['scopes']} scopes)"),
            ("vectors", f"{numbers['facts'] - numbers['without_vector']} facts; "
                        f"{numbers['without_vector']} without one (kvmem reembed)"),
            ("history", f"{numbers['history_events']} events; {numbers['deleted_facts']} deleted facts"),
            ("kv blobs", f"{numbers['kv_blobs']} on disk, {numbers['kv_bytes']:,} bytes")]
    if args.user is None and numbers["top_users"]:
        rows.append((f"top {args.top}", ", ".join(f"{u} {n}" for u, n in numbers["top_users"].items())))
    print("\n".join(f"{name:9}  {value}" for name, value in rows))
    return 0


# -- parsing ----------------------------------------------------------------------------------------


def add_parsers(sub) -> None:
    """list, get, history, update, stats (an argparse table)."""
    p = sub.add_parser("list", help="list stored facts, oldest first (no engine, no model)",
                       description="List stored facts, oldest first, a page at a time: one user's (narrowed by "
                                   "--agent, --run, --filters) or, without --user, every user's.")
    p.add_argument("--user", help="whose facts (default: every user's)")
    p.add_argument("--agent", help="narrow to one agent id")
    p.add_argument("--run", help="narrow to one run (session) id")
    p.add_argument("--filters", metavar="JSON", help='metadata filters as a JSON object, e.g. \'{"topic": "pets"}\'')
    p.add_argument("--limit", type=positive_int, default=100, help="facts per page, at most 10000 (default: 100)")
    p.add_argument("--offset", type=non_negative_int, default=0, help="facts to skip (default: 0)")
    p.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("get", help="show every field of facts by id (no engine, no model)",
                       description="Show each fact's text, scope, metadata, origin, context, times, KV status "
                                   "and KV blob bytes.")
    p.add_argument("ids", nargs="+", metavar="ID", help="fact ids")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.set_defaults(func=cmd_get)

    p = sub.add_parser("history", help="show a fact's ADD, UPDATE and DELETE events (no engine, no model)",
                       description="Show a fact's events, oldest first; kept after a delete, without its words.")
    p.add_argument("id", metavar="ID", help="a fact id")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.set_defaults(func=cmd_history)

    p = sub.add_parser("update", help="change a fact's text or metadata (no engine; KV re-encoded later)",
                       description="Give a fact new text (re-embedded now; its old KV dropped, the new one "
                                   "encoded the next time an engine starts) and/or new metadata (replacing "
                                   "the old). Reads the model's tokenizer to check the text fits, as add does.")
    p.add_argument("id", metavar="ID", help="a fact id")
    p.add_argument("text", nargs="?", metavar="TEXT", help="the new text (default: keep it)")
    p.add_argument("--metadata", metavar="JSON", help="new metadata, a JSON object replacing the old")
    p.set_defaults(func=cmd_update)

    p = sub.add_parser("stats", help="count facts, users, history and KV blobs (no engine, no model)",
                       description="Facts by KV status, users and scopes, facts without a search vector, "
                                   "history events, deleted facts, and KV blobs on disk.")
    p.add_argument("--user", help="one user's numbers (default: the whole home)")
    p.add_argument("--top", type=positive_int, default=10, help="users with the most facts to name (default: 10)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    p.set_defaults(func=cmd_stats)
