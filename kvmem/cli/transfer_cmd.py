"""`kvmem export | import`: a home's memory as JSON lines, and back into a home (kvmem/facts/bulk.py).

Export writes a header line, then one line per fact with its text, metadata, origin, times and
history, then one line per deleted fact with its history alone. KV blobs are not exported: they
are made again from the text, and a blob only serves the model that made it.

Import reads the whole file and checks every line first; one bad line is reported with its number
and nothing is stored (or, with --skip-invalid, everything but the bad lines). Lines are then
stored as they were (ids, times, history events), so importing a file twice stores nothing the
second time. Imported facts get their search vectors now (the embedder, not the chat model) and
their KV later: they stay pending until an engine starts (kvmem serve encodes them in the
background). Neither command starts the engine or loads the chat model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import IO, Any

from kvmem.cli.inspect_cmd import ENCODE_LATER, open_store
from kvmem.config import Config
from kvmem.errors import InvalidInputError

SHOWN_ERRORS = 20  # bad lines reported one by one; the rest are counted
_BATCH = 256  # facts embedded and stored per transaction: an interrupted import keeps whole batches


# -- export -----------------------------------------------------------------------------------------


def cmd_export(args: argparse.Namespace, config: Config) -> int:
    """Write a scope's facts (or every fact) with their histories as JSON lines."""
    from kvmem.facts import bulk

    if args.all and (args.agent or args.run):
        raise InvalidInputError("--agent and --run narrow a --user, not --all", param="--all")
    scope = None if args.all else {"user_id": args.user, "agent_id": args.agent, "run_id": args.run}
    counts: Counter[str] = Counter()
    with open_store(config) as store, _output(args.output) as out:
        out.write(_line(bulk.header(scope)))
        for line in store.export(**(scope or {})):
            out.write(_line(line))
            counts["deleted" if line.get("deleted") else "facts"] += 1
    where = "stdout" if args.output in (None, "-") else args.output
    print(f"exported {counts['facts']} facts and {counts['deleted']} deleted facts' histories to {where}",
          file=sys.stderr)
    return 0


def _line(obj: dict[str, Any]) -> str:
    return json.dumps(obj, ensure_ascii=False, allow_nan=False) + "\n"


class _output:
    """stdout, or a file written whole or not at all (a temp file renamed into place on success)."""

    def __init__(self, path: str | None) -> None:
        self.path = None if path in (None, "-") else Path(path)
        self.tmp: str | None = None

    def __enter__(self) -> IO[str]:
        if self.path is None:
            return sys.stdout
        try:
            fd, self.tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
        except OSError as e:
            raise InvalidInputError(f"cannot write --output {self.path}: {e.strerror or e}", param="--output") from e
        self.file = os.fdopen(fd, "w", encoding="utf-8")
        return self.file

    def __exit__(self, kind, *rest) -> None:
        if self.path is None:
            sys.stdout.flush()
            return
        self.file.close()
        if kind is None:
            os.replace(self.tmp, self.path)
        else:
            os.unlink(self.tmp)


# -- import -----------------------------------------------------------------------------------------


def cmd_import(args: argparse.Namespace, config: Config) -> int:
    """Check every line of an export, then store them as they were; ids already here are skipped."""
    items, errors, lines = read_items(args.file)
    for number, message in errors[:SHOWN_ERRORS]:
        print(f"kvmem: {_source(args.file)} line {number}: {message}", file=sys.stderr)
    if len(errors) > SHOWN_ERRORS:
        print(f"kvmem: ... and {len(errors) - SHOWN_ERRORS} more invalid lines", file=sys.stderr)
    if errors and not args.skip_invalid:
        raise InvalidInputError(f"{len(errors)} of {lines} lines of {_source(args.file)} are invalid; nothing was "
                                "imported (fix them, or --skip-invalid to import the other lines)", param="FILE")
    if args.dry_run:
        print(f"{len(items)} lines would be imported" + (f", {len(errors)} skipped as invalid" if errors else ""))
        return 0
    with open_store(config, create=True) as store:
        counts = store_items(store, items)
    print(_import_summary(counts, len(errors)))
    return 0


def read_items(path: str) -> tuple[list, list[tuple[int, str]], int]:
    """(the valid lines parsed, (line number, why) of each invalid one, lines read). Blank lines
    are skipped; a fact id on two lines is refused on the second."""
    from kvmem.facts import bulk

    items, errors, seen = [], [], {}
    now, number = time.time(), 0
    with _input(path) as f:
        for number, raw in enumerate(f, 1):
            try:
                text = raw.decode("utf-8-sig" if number == 1 else "utf-8")  # a BOM some editors write
                if not text.strip():
                    continue
                item = bulk.parse(json.loads(text), now)
            except UnicodeDecodeError as e:
                errors.append((number, f"not UTF-8 text ({e.reason} at byte {e.start})"))
                continue
            except json.JSONDecodeError as e:
                errors.append((number, f"not valid JSON: {e.msg} at column {e.colno}"))
                continue
            except InvalidInputError as e:
                errors.append((number, str(e)))
                continue
            if item is None:  # a header line
                continue
            if item.fact_id in seen:
                errors.append((number, f"fact id {item.fact_id!r} is on line {seen[item.fact_id]} already"))
                continue
            seen[item.fact_id] = number
            items.append(item)
    return items, errors, number


class _input:
    """The file's lines as bytes (so a line that is not UTF-8 is reported by number), or stdin's."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __enter__(self):
        if self.path == "-":
            return sys.stdin.buffer
        try:
            self.file = open(self.path, "rb")  # noqa: SIM115 - closed by __exit__
        except OSError as e:
            raise InvalidInputError(f"cannot read {self.path}: {e.strerror or e}", param="FILE") from e
        return self.file

    def __exit__(self, *exc) -> None:
        if self.path != "-":
            self.file.close()


def store_items(store, items: list) -> Counter[str]:
    """Embed and store the items not already here, a batch per transaction -> outcome counts
    ("facts", "deleted", "present", "duplicate")."""
    from tqdm import tqdm

    # Sorted out before embedding, so that a second import of a file costs no embedding either.
    known = store.known_ids(item.fact_id for item in items)
    fresh = [item for item in items if item.fact_id not in known]
    repeated = store.duplicate_ids(fresh)
    todo = [item for item in fresh if item.fact_id not in repeated]
    counts: Counter[str] = Counter(present=len(known), duplicate=len(repeated))
    embed = _embedder() if any(item.row is not None for item in todo) else None
    with tqdm(total=len(todo), desc="importing", unit="fact", disable=None, file=sys.stderr) as bar:
        for start in range(0, len(todo), _BATCH):
            batch = _with_vectors(todo[start:start + _BATCH], embed)
            for item, outcome in zip(batch, store.import_facts(batch)):
                counts[("facts" if item.row is not None else "deleted") if outcome == "created" else outcome] += 1
            bar.update(len(batch))
    return counts


def _embedder():
    """The search-vector maker every stored fact's vector comes from (kvmem.embed.fact)."""
    from kvmem.embed import default_embedder
    from kvmem.embed.fact import fact_vectors

    embedder = default_embedder()
    return lambda rows: fact_vectors(embedder, [r["text"] for r in rows], [r["context"] for r in rows],
                                     [r["origin"] for r in rows])


def _with_vectors(batch: list, embed) -> list:
    live = [item for item in batch if item.row is not None]
    if not live:
        return batch
    vectors = iter(embed([item.row for item in live]))  # [n, dim]
    return [item.embedded(next(vectors)) if item.row is not None else item for item in batch]


def _import_summary(counts: Counter[str], invalid: int) -> str:
    summary = f"imported {counts['facts']} facts and {counts['deleted']} deleted facts' histories"
    skipped = [f"{counts['present']} already here", f"{counts['duplicate']} duplicates of facts stored here"]
    summary += "; skipped " + ", ".join(skipped) + (f", {invalid} invalid lines" if invalid else "")
    if counts["facts"]:
        summary += f"\nthe imported facts are searchable now; {ENCODE_LATER.replace('its KV is', 'their KV is')}"
    return summary


def _source(path: str) -> str:
    return "stdin" if path == "-" else path


# -- parsing ----------------------------------------------------------------------------------------


def add_parsers(sub) -> None:
    """export, import (an argparse table)."""
    p = sub.add_parser("export", help="write a user's (or every) fact and its history as JSON lines (no engine)",
                       description="Write facts as JSON lines: a header, then each fact with its text, metadata, "
                                   "origin, context, times and history, then each deleted fact's history. KV "
                                   "blobs are not exported: `kvmem import` has them encoded again.")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--user", help="export this user's facts (narrowed by --agent/--run)")
    what.add_argument("--all", action="store_true", help="export every user's facts")
    p.add_argument("--agent", help="narrow to one agent id")
    p.add_argument("--run", help="narrow to one run (session) id")
    p.add_argument("-o", "--output", metavar="FILE.jsonl", help="write here (whole or not at all); default stdout")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("import", help="store the facts of a `kvmem export` file (no engine; idempotent)",
                       description="Check every line of FILE, then store its facts with their ids, times and "
                                   "histories. Facts whose id is already here are skipped, so importing twice "
                                   "stores nothing new. Any invalid line is reported with its number and nothing "
                                   "is stored. Search vectors are made now; KV is encoded when an engine starts.")
    p.add_argument("file", metavar="FILE", help="a JSON-lines file from kvmem export; '-' reads stdin")
    p.add_argument("--skip-invalid", action="store_true", help="store the valid lines even if some are not")
    p.add_argument("--dry-run", action="store_true", help="check the file only; store nothing")
    p.set_defaults(func=cmd_import)
