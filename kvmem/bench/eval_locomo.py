"""`kvmem eval locomo`: answer quality of KV injection vs text prefill vs no memory, on LoCoMo.

Per question (categories 1-4) the top-k facts are retrieved once and used, in stored order, by
all three modes; each mode answers greedily and scores the gold answer by teacher forcing.
Then text mode answers every question again under another batch composition: the engine's own
noise floor, which KV mode's agreement with text is read against (bench/noise_floor.py).
With `codecs`, KV mode also answers from each codec's re-coding of the same lossless blobs
(mode "kv_<codec>"), so codecs are compared on the same questions and text answers.
With `points` (fidelity points, kv/fidelity.py `parse`), KV mode also answers at each of them
(mode "kv@<point>") over the same facts: a run with points adds them to the rows already logged
and answers nothing else again, so the curve's points share one text pass, one no-memory pass
and one plain-injection pass, and are compared on the same questions and text answers.
Results are appended per question to a JSONL file (a question's last line wins), so an
interrupted run resumes. Only the facts the questions read are encoded (all of them with codecs).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from kvmem.bench import locomo, noise_floor
from kvmem.bench.eval_extract import TURNS_PER_ADD, extract_conversation, user_of
from kvmem.bench.eval_report import VARIANTS
from kvmem.bench.metrics import first_token, locomo_f1
from kvmem.errors import InvalidInputError
from kvmem.kv.fidelity import parse as parse_point

MODES = ("text", "kv", "off")


# Turns are encoded after the 2 turns before them (chosen on LoCoMo, docs/benchmarks.md).
# Observations are written to stand alone; encoding them after their evidence turns brought the
# first token closer to text mode but lost log-likelihood and temporal F1, so by default they
# get no context.
# With both stored, `window` is the turns' window and `observation_window` the observations' (0).
# Extracted facts (eval_extract's memory) are stored bare, as add(infer=True) stores them.
DEFAULT_WINDOW = {"observations": 0, "turns": 2, "both": 2, "extracted": 0}


@dataclass(frozen=True)
class EvalConfig:
    data: Path
    conversations: tuple[str, ...] = ()  # sample ids; empty = all
    k: int = 10
    memory: str = "observations"  # or "turns", "both" (each observation and each turn a fact), "extracted"
    window: int | None = None  # None: DEFAULT_WINDOW[memory]
    limit: int | None = None  # questions per conversation, drawn at random (seeded)
    seed: int = 0
    max_tokens: int = 32
    workers: int = 4
    ranking: str | None = None  # None: the service's configured retrieval (hybrid by default)
    codecs: tuple[str, ...] = ()  # KV codecs to answer with too, re-coded from the lossless blobs
    text_facts: int = 0  # the last facts KV mode prefills as text (the service's kv.text_facts, set by the caller)
    text_facts_rule: str = "last"  # which: the service's kv.text_facts_rule, set by the caller
    observation_window: int | None = None  # with memory "both": the observations' window (None: 0)
    observation_origin: bool = False  # observations searched with the turn they restate (never encoded)
    recompute: str = "off"  # the service's kv.recompute setting (Recompute.tag), set by the caller: names the run
    noise_floor: bool = True  # answer every question again in text mode under another batch (bench/noise_floor.py)
    points: tuple[str, ...] = ()  # fidelity points KV mode also answers at ("kv@<point>"); not part of the name

    def __post_init__(self):
        if self.memory not in DEFAULT_WINDOW:
            raise InvalidInputError(f"memory must be one of {tuple(DEFAULT_WINDOW)}, got {self.memory!r}",
                                    param="memory")
        if self.memory == "extracted" and self.window:
            raise InvalidInputError("extracted facts are stored as add(infer=True) stores them: no window",
                                    param="window")
        if self.observation_window is not None and self.memory != "both":
            raise InvalidInputError("observation_window is for memory 'both'; with observations alone, "
                                    f"window is the observations' window (memory {self.memory!r})",
                                    param="observation_window")
        if self.observation_origin and self.memory in ("turns", "extracted"):
            raise InvalidInputError("observation_origin needs observations stored (memory 'observations' or 'both')",
                                    param="observation_origin")
        if self.observation_window is not None and (not isinstance(self.observation_window, int)
                                                    or self.observation_window < 0):
            raise InvalidInputError(f"observation_window must be an int >= 0, got {self.observation_window!r}",
                                    param="observation_window")
        for spec in self.points:
            try:
                parse_point(spec)
            except ValueError as e:
                raise InvalidInputError(str(e), param="points") from None

    @property
    def window_size(self) -> int:
        return DEFAULT_WINDOW[self.memory] if self.window is None else self.window

    @property
    def observation_window_size(self) -> int:
        """The turns an observation is stored after: `window` with observations alone."""
        if self.memory == "observations":
            return self.window_size
        return self.observation_window or DEFAULT_WINDOW["observations"]

    @property
    def memory_name(self) -> str:
        """"both-w2", "-o1" after it when observations are stored after their turn too, "-src" when
        they are searched with it."""
        if self.memory == "extracted":
            return f"extracted-t{TURNS_PER_ADD}"  # eval extract's reconciled memory (build_memory)
        o = self.observation_window_size if self.memory == "both" else 0
        return f"{self.memory}-w{self.window_size}" + (f"-o{o}" if o else "") + ("-src" if self.observation_origin else "")

    @property
    def name(self) -> str:
        sample = (f"-limit{self.limit}" + (f"-seed{self.seed}" if self.seed else "")) if self.limit else ""
        # A subset is part of the name, so resuming one run never mixes in another's questions.
        subset = "-" + "+".join(sorted(self.conversations)) if self.conversations else ""
        ranking = f"-{self.ranking}" if self.ranking else ""
        codecs = "-codecs-" + "+".join(self.codecs) if self.codecs else ""
        text = f"-text-facts-{self.text_facts}" if self.text_facts else ""
        text += "-relevant" if self.text_facts and self.text_facts_rule == "relevant" else ""
        rc = f"-recompute-{self.recompute}" if self.recompute != "off" else ""
        return f"locomo-{self.memory_name}-k{self.k}{sample}{subset}{ranking}{codecs}{text}{rc}"


def build_memory(mem, conv: dict, cfg: EvalConfig, *, encode: bool = True, log_dir: Path | None = None) -> str:
    """Store the conversation's memory under its own user (and encode all its KV); returns that user id.
    Extracted memory is built (or resumed) by eval extract's code, its log in `log_dir`."""
    user = f"locomo-{conv['sample_id']}-{cfg.memory_name}"
    if cfg.memory == "extracted":
        user = user_of(mem, conv["sample_id"], TURNS_PER_ADD)  # named by the extracting LLM too
        extract_conversation(mem, conv, log_dir or mem.config.home / "eval")
    elif not mem.get_all(user_id=user, limit=1):  # else stored by an earlier (maybe interrupted) run
        _store(mem, conv, cfg, user)
    if encode:
        _encode(mem, mem.get_all(user_id=user, limit=10_000))
    return user


def encode_read(mem, user: str, questions: list[dict], cfg: EvalConfig) -> None:
    """Encode the facts these questions will read, and no others: retrieval needs no KV, and a
    sample of 10 questions reads a few hundred of a conversation's thousands of turns. Codec
    copies re-code every stored blob, so with codecs all the user's facts are encoded."""
    if cfg.codecs:
        records = mem.get_all(user_id=user, limit=10_000)
    else:
        records = list({r.id: r for q in questions for r in retrieve(mem, user, q, cfg)}.values())
    _encode(mem, records)


def _encode(mem, records: list) -> None:
    # Encoded for this model: facts stored under another model (same home) have no blob of ours.
    pending = [r for r in records if r.kv_status != "encoded"]
    if pending:
        mem.encoder.encode(pending, progress=True)


def _store(mem, conv: dict, cfg: EvalConfig, user: str) -> None:
    if cfg.memory in ("observations", "both"):
        template = mem.config.prompt.fact_template
        for o in locomo.observations(conv):
            context = locomo.observation_context(conv, o, cfg.observation_window_size, template)
            origin = locomo.observation_context(conv, o, 1, template) if cfg.observation_origin else ""
            mem.add(facts=[f"[{o.date}] {o.text}"], user_id=user, metadata={"dia_ids": list(o.dia_ids)},
                    context=context, origin=origin, encode="none")
    if cfg.memory in ("turns", "both"):
        for n, turns, date in locomo.sessions(conv):
            messages = [locomo.message(conv, t, date) for t in turns]
            mem.add(messages, user_id=user, metadata={"session": n}, window=cfg.window_size,
                    encode="none")


def dia_ids_of(record) -> set[str]:
    if "dia_ids" in record.metadata:
        return set(record.metadata["dia_ids"])
    return {f"D{record.metadata['session']}:{record.position + 1}"}


def retrieve(mem, user: str, q: dict, cfg: EvalConfig) -> list:
    """The question's top-k facts, in the order a chat places them (stored order)."""
    hits = mem.search(q["question"], user_id=user, k=cfg.k, ranking=cfg.ranking)
    return sorted((mem.get(h.id) for h in hits), key=lambda r: (r.created_at, r.position or 0, r.id))


def codec_copies(mem, user: str, codecs: tuple[str, ...]) -> dict[str, tuple[str, dict[str, str]]]:
    """Per codec: (a user holding the facts re-coded in it, base fact id -> copy's fact id)."""
    from kvmem.bench.codecs import recoded_copy

    records = mem.get_all(user_id=user, limit=10_000)
    originals = [mem.kv.get(r.id) for r in records]
    copies = {}
    for codec in codecs:
        own = recoded_copy(mem, f"{user}-{codec}", [r.text for r in records], originals, codec)
        copies[codec] = (f"{user}-{codec}", dict(zip((r.id for r in records), own)))
    return copies


def answer_question(mem, user: str, q: dict, cfg: EvalConfig, copies: dict | None = None,
                    row: dict | None = None) -> dict:
    """copies: codec_copies() of the user, for the kv_<codec> modes. `row`: this question's logged
    row, to which only the modes it lacks are added (over its own facts)."""
    if row is None:
        records = retrieve(mem, user, q, cfg)
        found = set().union(*(dia_ids_of(r) for r in records)) if records else set()
        evidence = {e.strip() for e in q.get("evidence", []) if isinstance(e, str)}
        row = {"question": q["question"], "answer": str(q["answer"]), "category": q["category"],
               "fact_ids": [r.id for r in records],
               "recall": len(evidence & found) / len(evidence) if evidence else None}
    else:
        row = dict(row)
    ids, gold = row["fact_ids"], row["answer"]
    for mode, (engine_mode, options) in _modes(mem, cfg.points).items():
        if mode not in row:
            row[mode] = _answer(mem, q["question"], gold, q["category"], user, ids, cfg, engine_mode, options)
    for codec, (copy_user, id_of) in (copies or {}).items():  # as served: with the reader, if any
        if f"kv_{codec}" not in row:
            row[f"kv_{codec}"] = _answer(mem, q["question"], gold, q["category"], copy_user,
                                         [id_of[i] for i in ids], cfg, "kv", {})
        row[f"top1_agree_lossless_{codec}"] = first_token(row["kv"]["first"], row[f"kv_{codec}"]["first"])[0]
    for mode in ("kv", *VARIANTS, *(f"kv_{c}" for c in (copies or {})), *(f"kv@{p}" for p in cfg.points)):
        suffix = mode.removeprefix("kv")
        if mode in row:
            row["top1_agree" + suffix], row["kl_text_kv" + suffix] = first_token(row["text"]["first"], row[mode]["first"])
            row["top1_agree_tie" + suffix] = _tie_aware(row["text"]["first"], row[mode]["first"])
            row["same_answer" + suffix] = row[mode]["answer"] == row["text"]["answer"]
    return row


def _answer(mem, question: str, gold: str, category, user: str, ids: list[str], cfg: EvalConfig,
            mode: str, options: dict) -> dict:
    """One mode's greedy answer, its F1, the gold answer's mean log-likelihood, its first token's logprobs."""
    r = mem.chat(question, user_id=user, fact_ids=ids, mode=mode, max_tokens=cfg.max_tokens, **options)
    lls = mem.score(question, gold, user_id=user, fact_ids=ids, mode=mode, **options)
    return {"answer": r.answer, "f1": locomo_f1(r.answer, gold, category), "ll": sum(lls) / len(lls),
            "ttft_s": r.ttft_s, "first": {str(t): v for t, v in r.first_logprobs.items()}}


def _modes(mem, points: tuple[str, ...] = ()) -> dict[str, tuple[str, dict]]:
    """Each answering mode of a question -> (the chat's mode, its options). With a reader adapter,
    "kv" reads with it and "kv_plain" is the same chat without it; with kv.recompute on, "kv"
    recomputes and "kv_norc" is the same chat with plain injection; "kv@<point>" is KV mode at
    that fidelity point."""
    from kvmem.kv.recompute import Recompute

    modes = {m: (m, {}) for m in MODES}
    if mem.engine.reader_adapter:
        modes["kv_plain"] = ("kv", {"reader": False})
    if mem.config.kv.recompute_setting.on:
        modes["kv_norc"] = ("kv", {"recompute": Recompute(0.0)})
    for spec in points:
        at = parse_point(spec)
        modes[f"kv@{spec}"] = ("kv", {"recompute": at.recompute, "text_facts": at.text_facts})
    return modes


def _tie_aware(text: dict, kv: dict) -> bool | None:
    """Top-1 agreement that counts a question whose text-mode top-2 first tokens are within bf16
    resolution of each other (|a - b| <= 2^-8 max(|a|, |b|)) as agreeing if kv picks either."""
    if not text or not kv:
        return None
    (t1, a), (t2, b) = sorted(((int(t), v) for t, v in text.items()), key=lambda x: -x[1])[:2]
    pick = int(max(kv, key=kv.get))
    return pick in (t1, t2) if abs(a - b) <= 2 ** -8 * max(abs(a), abs(b)) else pick == t1


def log_name(cfg: EvalConfig, fingerprint: str, adapter: Path | None) -> str:
    """The resume log's file name. Per model and per reader adapter (whose rows carry kv_plain
    too): resuming must never pick up answers another model or adapter gave in the same home."""
    from kvmem.reader.adapters import identity

    reader = f".reader-{identity(adapter)}" if adapter else ""
    return f"{cfg.name}.{fingerprint[:12]}{reader}.jsonl"


def run(mem, cfg: EvalConfig, out_dir: Path) -> list[dict]:
    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = out_dir / log_name(cfg, mem.model.fingerprint, mem.engine.reader_adapter)
    done = _logged(log_path)
    convs = [c for c in locomo.load(cfg.data) if not cfg.conversations or c["sample_id"] in cfg.conversations]
    if cfg.codecs and mem.config.kv.codec != "none":
        raise SystemExit("comparing codecs re-codes lossless blobs: run with the default codec (none)")
    wanted = [f"kv@{p}" for p in cfg.points]
    jobs, copies, users = [], {}, {}
    for conv in convs:
        user = users[conv["sample_id"]] = build_memory(mem, conv, cfg, encode=False, log_dir=out_dir)
        todo = []
        for i, q in locomo.sample_questions(conv, cfg.limit, cfg.seed):
            row = done.get(f"{conv['sample_id']}#{i}")
            if row is None or any(m not in row for m in wanted):
                todo.append((user, conv["sample_id"], i, q, row))
        if todo:
            encode_read(mem, user, [q for *_, q, _ in todo], cfg)
        if todo and cfg.codecs:
            copies[user] = codec_copies(mem, user, cfg.codecs)
        jobs += todo
    with log_path.open("a") as log, ThreadPoolExecutor(cfg.workers) as pool, \
            tqdm(total=len(jobs), desc=f"eval {cfg.name}", unit="q") as bar:
        futures = [(sid, i, pool.submit(answer_question, mem, user, q, cfg, copies.get(user), row))
                   for user, sid, i, q, row in jobs]
        for sid, i, fut in futures:
            row = fut.result()
            row.update(key=f"{sid}#{i}", conversation=sid)
            log.write(json.dumps(row) + "\n")
            log.flush()
            bar.update()
    rows = list(_logged(log_path).values())
    if not cfg.noise_floor:
        return rows
    second = noise_floor.second_text_pass(mem, rows, users, noise_floor.workers_for(cfg.workers), cfg.max_tokens,
                                          log_path)
    return noise_floor.attach(rows, second)


def _logged(log_path: Path) -> dict[str, dict]:
    """The log's rows by question key, in first-logged order; a question's last line wins (a run
    with points appends its rows again, with the points added)."""
    rows: dict[str, dict] = {}
    if log_path.exists():
        for line in log_path.open():
            row = json.loads(line)
            rows[row["key"]] = row
    return rows
