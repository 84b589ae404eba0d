"""`kvmem eval retrieval`: evidence recall@k of each ranking on LoCoMo memory.

No engine: facts are stored and searched only. Per question (categories 1-4 with evidence),
recall@k is the share of its evidence turns among the sources of the top-k facts. Each ranking
("dense", "lexical", "hybrid") is asked for the largest k once; smaller k are its prefixes.
Search latency per query is reported beside (embedding the query included).

Memory: LoCoMo's observations (one fact per observation, its session date in front), the raw
turns (one fact per turn, as `add(messages)` stores a conversation: searched with the `window`
turns before it), or both in one scope. `observation_window` stores each observation after the turns
ending at its evidence (1: the turn it restates), searched (and encoded) with them as a turn is;
`observation_origin` gives each the turn it restates as its origin (searched with, never encoded).
`novel=True` skips a hit whose sources the hits above it already cover (with both stored, an
observation and the turn it sums up otherwise take two of the k places for one piece of evidence).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from tqdm import tqdm

from kvmem.bench import locomo
from kvmem.bench.eval_locomo import dia_ids_of
from kvmem.bench.report import write_json
from kvmem.config import RETRIEVAL_MODES
from kvmem.errors import InvalidInputError

KS = (5, 10, 20)
CATEGORIES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop"}


MEMORIES = ("observations", "turns", "both")
NOVEL_DEPTH = 3  # a novel ranking reads this many times the largest k before skipping


def memory_suffix(memory: str, window: int, observation_window: int, observation_origin: bool = False) -> str:
    """What a user id and a result name add for the memory: "-both-w2", "-o1" when observations
    have a window, "-src" when they have their turn as origin (none of these for observations
    alone at window 0, as before the options)."""
    turns = "" if memory == "observations" else f"-{memory}-w{window}"
    if memory == "turns":
        return turns
    return turns + (f"-o{observation_window}" if observation_window else "") + ("-src" if observation_origin else "")


def build(mem, conv: dict, memory: str = "observations", window: int = 2, observation_window: int = 0,
          observation_origin: bool = False) -> str:
    """The conversation's memory under its own user (kept from an earlier run)."""
    user = f"retrieval-{conv['sample_id']}" + memory_suffix(memory, window, observation_window, observation_origin)
    if mem.get_all(user_id=user, limit=1):
        return user
    if memory in ("observations", "both"):
        template = mem.config.prompt.fact_template
        for o in locomo.observations(conv):
            origin = locomo.observation_context(conv, o, 1, template) if observation_origin else ""
            mem.add(facts=[f"[{o.date}] {o.text}"], user_id=user, metadata={"dia_ids": list(o.dia_ids)},
                    context=locomo.observation_context(conv, o, observation_window, template), origin=origin,
                    encode="none")
    if memory in ("turns", "both"):
        for n, turns, date in locomo.sessions(conv):
            messages = [locomo.message(conv, t, date) for t in turns]
            mem.add(messages, user_id=user, metadata={"session": n}, window=window, encode="none")
    return user


def novel(sources: list[set[str]], k: int) -> list[int]:
    """Positions of the first k hits that each bring a source the hits kept before lack."""
    kept, seen = [], set()
    for i, src in enumerate(sources):
        if src - seen:
            kept.append(i)
            seen |= src
            if len(kept) == k:
                break
    return kept


def run(mem, data: Path, conversations: tuple[str, ...], rankings=RETRIEVAL_MODES, ks=KS,
        memory: str = "observations", novel_only: bool = False, window: int = 2, observation_window: int = 0,
        observation_origin: bool = False) -> dict:
    if memory not in MEMORIES:
        raise InvalidInputError(f"memory must be one of {MEMORIES}, got {memory!r}", param="memory")
    if not isinstance(observation_window, int) or observation_window < 0:
        raise InvalidInputError(f"observation_window must be an int >= 0, got {observation_window!r}",
                                param="observation_window")
    convs = [c for c in locomo.load(data) if not conversations or c["sample_id"] in conversations]
    rows, latency = [], {r: [] for r in rankings}
    depth = max(ks) * (NOVEL_DEPTH if novel_only else 1)
    for conv in tqdm(convs, desc="eval retrieval", unit="conv"):
        user = build(mem, conv, memory, window, observation_window, observation_origin)
        for q in locomo.questions(conv):
            evidence = {e.strip() for e in q.get("evidence", []) if isinstance(e, str)}
            if not evidence:
                continue
            row = {"conversation": conv["sample_id"], "category": q["category"]}
            for ranking in rankings:
                start = time.perf_counter()
                hits = mem.search(q["question"], user_id=user, k=depth, ranking=ranking)
                latency[ranking].append(time.perf_counter() - start)
                sources = [dia_ids_of(mem.get(h.id)) for h in hits]
                sources = [sources[i] for i in novel(sources, max(ks))] if novel_only else sources[: max(ks)]
                row[ranking] = {k: len(evidence & set().union(*sources[:k])) / len(evidence) for k in ks}
            rows.append(row)
    return {"conversations": [c["sample_id"] for c in convs], "memory": memory, "novel": novel_only, "window": window,
            "observation_window": observation_window, "observation_origin": observation_origin,
            "ks": list(ks), "rankings": list(rankings),
            "recall": _table(rows, rankings, ks), "questions": len(rows),
            "search_ms_p50": {r: 1e3 * statistics.median(v) for r, v in latency.items() if v}}


def _table(rows: list[dict], rankings, ks) -> dict:
    """ranking -> group ("overall", "multi-hop", ...) -> k -> mean recall (and n)."""
    groups = {"overall": rows, **{name: [r for r in rows if r["category"] == c] for c, name in CATEGORIES.items()}}
    return {ranking: {g: {"n": len(rs), **{str(k): (sum(r[ranking][k] for r in rs) / len(rs) if rs else None)
                                          for k in ks}}
                      for g, rs in groups.items()}
            for ranking in rankings}


def report(result: dict, out: Path) -> str:
    path = write_json(result, out.with_suffix(".json"))
    ks = result["ks"]
    how = result.get("memory", "observations") + (", novel hits only" if result.get("novel") else "")
    if result.get("memory", "observations") != "observations":
        how += f", turns searched with the {result.get('window', 0)} before"
    if result.get("observation_window") and result.get("memory") != "turns":
        how += f", observations with the {result['observation_window']} turn(s) ending at their evidence"
    if result.get("observation_origin") and result.get("memory") != "turns":
        how += ", observations searched with the turn they restate (origin)"
    lines = [f"Evidence recall@k on {', '.join(result['conversations'])} ({result['questions']} questions; {how})", "",
             "| ranking | group | n | " + " | ".join(f"recall@{k}" for k in ks) + " |",
             "|---|---|---|" + "---|" * len(ks)]
    for ranking, groups in result["recall"].items():
        for group, cells in groups.items():
            values = " | ".join("-" if cells[str(k)] is None else f"{cells[str(k)]:.3f}" for k in ks)
            lines.append(f"| {ranking} | {group} | {cells['n']} | {values} |")
    lines += ["", "search p50 (ms, query embedding included): " +
              ", ".join(f"{r} {ms:.2f}" for r, ms in result["search_ms_p50"].items()), f"wrote {path}"]
    return "\n".join(lines)
