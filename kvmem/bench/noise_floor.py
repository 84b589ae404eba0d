"""The engine's own noise floor for answer fidelity: text mode answering the same questions again.

KV mode's answers are judged against text prefill's. But greedy text prefill does not always give
the same answer twice either: vLLM's batches differ from run to run (which requests share a step,
how many tokens each brings), and on some hosts the kernels' rounding depends on that. So
`eval locomo` answers every question a second time in text mode under another batch composition:
the prefix cache reset, another concurrency (one request at a time where the first pass ran
several, else several) and the questions in reverse order. KV mode's agreement with text is then
read against text's agreement with itself (eval_report: "same answer relative to the noise floor").

The second pass is logged per question beside the first pass's log (`<log>.text2.jsonl`), so an
interrupted run resumes it too.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

from kvmem.bench.metrics import first_token, locomo_f1


def log_path_of(log_path: Path) -> Path:
    return log_path.with_suffix(".text2.jsonl")


def workers_for(first_pass_workers: int) -> int:
    """Another concurrency than the first pass's, so that steps batch other requests together."""
    return 1 if first_pass_workers > 1 else 4


def second_text_pass(mem, rows: list[dict], users: dict[str, str], workers: int, max_tokens: int,
                     log_path: Path) -> dict[str, dict]:
    """Answer each row's question again in text mode over the same facts, in reverse order with
    `workers` at a time after a prefix-cache reset; -> key -> {"answer", "f1", "first"}."""
    path = log_path_of(log_path)
    done = {}
    if path.exists():
        for line in path.open():
            rec = json.loads(line)
            done[rec.pop("key")] = rec
    todo = [r for r in reversed(rows) if r["key"] not in done]
    if not todo:
        return done
    mem.engine.reset_prefix_cache()

    def answer(row: dict) -> dict:
        r = mem.chat(row["question"], user_id=users[row["conversation"]], fact_ids=row["fact_ids"], mode="text",
                     max_tokens=max_tokens)
        return {"answer": r.answer, "f1": locomo_f1(r.answer, row["answer"], row["category"]),
                "first": {str(t): v for t, v in r.first_logprobs.items()}}

    with path.open("a") as log, ThreadPoolExecutor(workers) as pool, \
            tqdm(total=len(todo), desc=f"noise floor: text again, {workers} at a time", unit="q") as bar:
        for row, rec in zip(todo, pool.map(answer, todo)):
            log.write(json.dumps({"key": row["key"], **rec}) + "\n")
            log.flush()
            done[row["key"]] = rec
            bar.update()
    return done


def attach(rows: list[dict], second: dict[str, dict]) -> list[dict]:
    """Each row with its second text answer ("text2") and how it compares with the first: same
    answer, same first token, KL(text || text2) over text's top 20 (rows without one unchanged)."""
    for row in rows:
        rec = second.get(row["key"])
        if rec is None:
            continue
        row["text2"] = rec
        row["same_answer_text2"] = rec["answer"] == row["text"]["answer"]
        row["top1_agree_text2"], row["kl_text_text2"] = first_token(row["text"]["first"], rec["first"])
    return rows
