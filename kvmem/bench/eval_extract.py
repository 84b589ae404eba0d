"""`kvmem eval extract`: what `add(messages, infer=True)` keeps of a LoCoMo conversation.

Each conversation's sessions are added in order, `turns_per_add` turns per call, as a chat
client adds its exchanges. Both speakers are people, so every turn is a user message under its
speaker's name (the extraction prompt keeps facts about users only). Each call's facts are
extracted once, by the configured LLM (the served model, or `[extract] url`), and applied twice:
reconciled with what the user already holds (Mem0's ADD/UPDATE/DELETE/NONE), and all added
(reconcile=False), under two users - so the difference is reconciliation's alone.

Measured with no LLM in the loop:
- precision and recall per session against LoCoMo's own observations of that session: a fact
  and an observation match when the cosine similarity of their MiniLM embeddings is at least
  `threshold`. precision: the share of extracted facts that match some observation of the
  session; recall: the share of the session's observations some extracted fact matches. The
  session's turns, scored the same way, calibrate the threshold (what storing turns "recalls").
- stored facts after each session: reconciled, all added, turn by turn (one fact per turn, what
  add(infer=False) stores), and LoCoMo's observations.

Per add call a row goes to a JSONL log in the home (the facts quote LoCoMo, CC BY-NC), so an
interrupted run resumes where it stopped; `eval locomo --memory extracted` reads the reconciled
user this builds (extract_conversation), building it first when missing.
"""

from __future__ import annotations

import json
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from kvmem.bench import locomo
from kvmem.bench.metrics import bootstrap_ci
from kvmem.errors import InvalidInputError
from kvmem.facts.scope import Scope

TUNING = ("conv-26", "conv-30", "conv-41")  # the tuning split: never the reporting conversations
TURNS_PER_ADD = 8  # a few exchanges per call: Mem0's clients add after each exchange or two
THRESHOLDS = (0.5, 0.6, 0.7)  # reported; `threshold` (0.6) is the headline


@dataclass(frozen=True)
class ExtractEvalConfig:
    data: Path
    conversations: tuple[str, ...] = TUNING
    turns_per_add: int = TURNS_PER_ADD
    threshold: float = 0.6
    sessions: int | None = None  # the first N sessions of each conversation (None: all)
    workers: int = 3  # conversations extracted at once (each one's calls stay in order)

    def __post_init__(self):
        if not isinstance(self.turns_per_add, int) or self.turns_per_add < 1:
            raise InvalidInputError(f"turns_per_add must be an int >= 1, got {self.turns_per_add!r}",
                                    param="turns_per_add")
        if not 0 < self.threshold < 1:
            raise InvalidInputError(f"threshold must be in (0, 1), got {self.threshold!r}", param="threshold")
        if self.sessions is not None and self.sessions < 1:
            raise InvalidInputError(f"sessions must be >= 1, got {self.sessions!r}", param="sessions")

    @property
    def name(self) -> str:
        sessions = f"-s{self.sessions}" if self.sessions else ""
        return f"extract-{'+'.join(sorted(self.conversations))}-t{self.turns_per_add}{sessions}"


def user_of(mem, sample_id: str, turns_per_add: int, reconcile: bool = True) -> str:
    """The user holding a conversation's extracted memory; `eval locomo --memory extracted` reads
    the reconciled one. Named by the extracting LLM where it is not the served model, so two
    LLMs' memories never mix in one home."""
    tag = llm_tag(mem)
    return f"locomo-{sample_id}-extracted-t{turns_per_add}" + (f"-{tag}" if tag else "") + ("" if reconcile else "-plain")


def log_path_of(mem, out_dir: Path, sample_id: str, turns_per_add: int) -> Path:
    """One log per conversation, extracting LLM and served model (whose embedder and tokenizer
    shaped the stored facts): a run over several conversations and `eval locomo` share them."""
    return out_dir / f"{user_of(mem, sample_id, turns_per_add)}.{mem.model.fingerprint[:12]}.jsonl"


def llm_tag(mem) -> str:
    """"" for the served model, else a short hash of the endpoint's URL and model."""
    import hashlib

    extract = mem.config.extract
    if not extract.url:
        return ""
    return hashlib.sha256(f"{extract.url}|{extract.model or ''}".encode()).hexdigest()[:8]


def chunks(conv: dict, turns_per_add: int, sessions: int | None = None):
    """(session number, chunk number, its messages, its dia ids) in conversation order."""
    for n, turns, date in locomo.sessions(conv)[:sessions]:
        for c in range(0, len(turns), turns_per_add):
            part = turns[c : c + turns_per_add]
            messages = [{**locomo.message(conv, t, date), "role": "user"} for t in part]
            yield n, c // turns_per_add, messages, [t["dia_id"] for t in part if t.get("dia_id")]


def extract_conversation(mem, conv: dict, out_dir: Path, turns_per_add: int = TURNS_PER_ADD,
                         sessions: int | None = None, bar=None) -> list[dict]:
    """Add the conversation through infer, both ways (module doc), resuming from its log in
    `out_dir`; -> the log's rows for this conversation, in order."""
    sid = conv["sample_id"]
    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_path_of(mem, out_dir, sid, turns_per_add)
    done = {r["key"]: r for r in read_log(log_path)}
    reconciled, plain = (Scope(user_of(mem, sid, turns_per_add, r)) for r in (True, False))
    if not done and (mem.count(user_id=reconciled.user_id) or mem.count(user_id=plain.user_id)):
        # Its log is gone but its facts are not: counting on from them would measure another run.
        raise InvalidInputError(f"{reconciled.user_id} already holds facts but {log_path} is missing: delete the "
                                "user (kvmem delete-all) or use another home", param="conversations")
    rows = []
    for n, c, messages, dia_ids in chunks(conv, turns_per_add, sessions):
        key = f"{sid}#{n}#{c}"
        if key not in done:
            facts = mem.inferrer.extract(messages, reconciled)
            metadata = {"session": n, "dia_ids": dia_ids}
            events = [ch.event for ch in mem.inferrer.apply(facts, messages, reconciled, metadata=metadata,
                                                             encode="none").results]
            mem.inferrer.apply(facts, messages, plain, reconcile=False, metadata=metadata, encode="none")
            done[key] = {"key": key, "conversation": sid, "session": n, "chunk": c, "turns": len(messages),
                         "facts": facts, "events": dict(Counter(events)),
                         "stored": mem.count(user_id=reconciled.user_id), "stored_plain": mem.count(user_id=plain.user_id)}
            with log_path.open("a") as log:
                log.write(json.dumps(done[key]) + "\n")
        rows.append(done[key])
        if bar is not None:
            bar.update()
    return rows


def read_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.open()] if path.exists() else []


def run(mem, cfg: ExtractEvalConfig, out_dir: Path) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    convs = [c for c in locomo.load(cfg.data) if c["sample_id"] in cfg.conversations]
    missing = set(cfg.conversations) - {c["sample_id"] for c in convs}
    if missing:
        raise InvalidInputError(f"no conversation {sorted(missing)} in {cfg.data}", param="conversations")
    total = sum(1 for conv in convs for _ in chunks(conv, cfg.turns_per_add, cfg.sessions))
    with ThreadPoolExecutor(cfg.workers) as pool, tqdm(total=total, desc=f"eval {cfg.name}", unit="add") as bar:
        futures = [pool.submit(extract_conversation, mem, conv, out_dir, cfg.turns_per_add, cfg.sessions, bar)
                   for conv in convs]
        rows = {conv["sample_id"]: f.result() for conv, f in zip(convs, futures)}
    return {"config": {**asdict(cfg), "data": str(cfg.data)}, "llm": llm_name(mem),
            "conversations": {sid: score_conversation(mem.embedder, conv, rows[sid], cfg)
                              for sid, conv in ((c["sample_id"], c) for c in convs)}}


def llm_name(mem) -> str:
    """Which LLM extracted: the endpoint's URL and model, or the served model (never a key)."""
    extract = mem.config.extract
    if extract.url:
        return f"{extract.url} ({extract.model or 'its first model'})"
    return f"served model {mem.model.path.name}"


def score_conversation(embedder, conv: dict, rows: list[dict], cfg: ExtractEvalConfig) -> dict:
    """Per session precision/recall (module doc) and the memory's size after each session."""
    observations = locomo.observations(conv)
    sessions, growth, turns_so_far = [], [], 0
    for n, turns, _ in locomo.sessions(conv)[:cfg.sessions]:
        facts = [f for r in rows if r["session"] == n for f in r["facts"]]
        said = [o.text for o in observations if o.session == n]
        turn_texts = [locomo.turn_text(t) for t in turns if locomo.turn_text(t).strip()]
        sessions.append({"session": n, "facts": len(facts), "observations": len(said),
                         **match(embedder, facts, said, "facts", thresholds(cfg.threshold)),
                         **match(embedder, turn_texts, said, "turns", thresholds(cfg.threshold))})
        turns_so_far += len(turns)
        last = [r for r in rows if r["session"] <= n][-1]
        growth.append({"session": n, "turns": turns_so_far, "reconciled": last["stored"],
                       "all_added": last["stored_plain"],
                       "observations": sum(1 for o in observations if o.session <= n)})
    events = sum((Counter(r["events"]) for r in rows), Counter())
    return {"sessions": sessions, "growth": growth, "events": dict(events),
            "extracted": sum(len(r["facts"]) for r in rows), "summary": summarize(sessions, cfg.threshold)}


def thresholds(threshold: float) -> tuple[float, ...]:
    """THRESHOLDS and the headline one, in order: the thresholds every measure is reported at."""
    return tuple(sorted({*THRESHOLDS, threshold}))


def match(embedder, facts: list[str], observations: list[str], name: str, at: tuple[float, ...]) -> dict:
    """`name`_precision@t / `name`_recall@t for each threshold t in `at`; nan where a side is
    empty. Cosine similarity of unit vectors: a dot product."""
    if not facts or not observations:
        return {f"{name}_{m}@{t}": float("nan") for t in at for m in ("precision", "recall")}
    sim = embedder.embed(facts) @ embedder.embed(observations).T  # [facts, observations]
    out = {}
    for t in at:
        out[f"{name}_precision@{t}"] = float((sim.max(axis=1) >= t).mean())
        out[f"{name}_recall@{t}"] = float((sim.max(axis=0) >= t).mean())
    return out


def summarize(sessions: list[dict], threshold: float) -> dict:
    """Mean over sessions with a 95% bootstrap interval, per measure, at every threshold."""
    keys = [k for k in sessions[0] if "@" in k] if sessions else []
    out = {k: bootstrap_ci([s[k] for s in sessions]) for k in keys}
    out["threshold"] = threshold
    return out


def pooled(result: dict) -> dict:
    """Every conversation's sessions together: the headline numbers."""
    sessions = [s for c in result["conversations"].values() for s in c["sessions"]]
    out = summarize(sessions, result["config"]["threshold"])
    out["sessions"] = len(sessions)
    for key in ("extracted",):
        out[key] = sum(c[key] for c in result["conversations"].values())
    last = [c["growth"][-1] for c in result["conversations"].values()]
    for key in ("turns", "reconciled", "all_added", "observations"):
        out[f"stored_{key}"] = sum(g[key] for g in last)
    out["events"] = dict(sum((Counter(c["events"]) for c in result["conversations"].values()), Counter()))
    return out


def report(result: dict, out_dir: Path, name: str) -> str:
    """Write <name>.json (numbers only: no LoCoMo text) and return the summary table."""
    result = {**result, "overall": pooled(result)}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(result, indent=1))
    o, t = result["overall"], result["config"]["threshold"]
    at = thresholds(t)
    lines = [f"extraction by {result['llm']}: {o['sessions']} sessions, {o['extracted']} facts extracted",
             f"{'measure (mean over sessions [95% CI])':<38}" + "  ".join(f"{'@' + str(x):<20}" for x in at)]
    for label, key in (("facts: precision", "facts_precision"), ("facts: recall", "facts_recall"),
                       ("turns: precision", "turns_precision"), ("turns: recall", "turns_recall")):
        lines.append(f"{label:<38}" + "  ".join(f"{_cell(o.get(f'{key}@{x}')):<20}" for x in at))
    lines.append(f"headline threshold {t}; events {o['events']}")
    lines.append(f"stored after the whole conversation(s): reconciled {o['stored_reconciled']}, "
                 f"all added {o['stored_all_added']}, turn by turn {o['stored_turns']}, "
                 f"LoCoMo observations {o['stored_observations']}")
    return "\n".join(lines)


def _cell(ci) -> str:
    return "n/a" if ci is None or np.isnan(ci[0]) else f"{ci[0]:.3f} [{ci[1]:.2f}, {ci[2]:.2f}]"
