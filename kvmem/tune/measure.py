"""How far a KV-mode reader's next-token distributions are from text prefill's, over a reply.

All measurements here teacher-force the text-prefill model's own greedy reply, so every variant
is scored on the same tokens: first-token KL and top-1 agreement (what `kvmem eval locomo`
reports from the engine, there over the top-20 logprobs), and the mean KL and agreement over
the whole reply.
"""

from __future__ import annotations

import statistics

import torch
from tqdm import tqdm

from kvmem.tune.lab import KVMEM, Example, Layout, memory_cache, reply_logits, teacher_reply


def kl_per_token(teacher: torch.Tensor, student: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) per position, from logits (or log-probs) [n, vocab] -> [n]."""
    t = teacher.float().log_softmax(-1)
    return (t.exp() * (t - student.float().log_softmax(-1))).sum(-1)


def compare(teacher: torch.Tensor, student: torch.Tensor) -> dict[str, float]:
    kl = kl_per_token(teacher, student)
    agree = (teacher.argmax(-1) == student.argmax(-1)).float()
    return {"first_kl": kl[0].item(), "first_agree": agree[0].item(),
            "reply_kl": kl.mean().item(), "reply_agree": agree.mean().item()}


def tie_aware(teacher: torch.Tensor, student: torch.Tensor) -> float:
    """First-token agreement that forgives a tie: where text prefill's two best first tokens are
    within bf16 resolution of each other (|a - b| <= 2^-8 * max(|a|, |b|), log-probabilities),
    the student agrees if its top token is either of them. teacher, student: [n, vocab]."""
    top = teacher[0].float().log_softmax(-1).topk(2)
    a, b = top.values.tolist()
    pick = int(student[0].argmax())
    if abs(a - b) <= 2 ** -8 * max(abs(a), abs(b)):
        return float(pick in top.indices.tolist())
    return float(pick == int(top.indices[0]))


def summarize(rows: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.fmean(r[key] for r in rows) for key in rows[0]} if rows else {}


@torch.no_grad()
def diagnose(model, examples: list[Example], eos: set[int], layouts: dict[str, Layout],
             reply_tokens: int = 16, progress: bool = True) -> dict[str, dict[str, float]]:
    """Per layout, the mean of `compare` against text prefill over the examples."""
    rows: dict[str, list] = {name: [] for name in layouts}
    for ex in tqdm(examples, desc="diagnosis", unit="chat", disable=not progress):
        reply, teacher = teacher_reply(model, ex, reply_tokens, eos)
        for name, layout in layouts.items():
            rows[name].append(compare(teacher, reply_logits(model, ex, reply, memory_cache(model, ex, layout))))
    return {name: summarize(r) for name, r in rows.items()}


LAYOUTS = {
    "kvmem (after header, moved)": KVMEM,
    "(a) after header, true positions": Layout("head", moved=False),
    "(c) after neutral sink, moved": Layout("sink", moved=True),
    "(a+c) after neutral sink, true positions": Layout("sink", moved=False),
}
