"""`kvmem bench oracle`: injected KV against text prefill of the same prompt, on the served model.

k=1: each fact alone, encoded after the system prefix and injected where it was encoded, so
injection must reproduce text prefill up to the engine's own bf16 noise. The yardstick is that
noise: the engine's prefix-cache hit path against a fresh prefill of the same prompt. k=10: the
facts encoded independently and injected together, an approximation (facts do not attend to
each other), reported as first-token agreement and KL over text mode's top 20.
"""

from __future__ import annotations

from pathlib import Path

from kvmem.bench.metrics import top20_kl
from kvmem.bench.report import write_json

FACTS = [
    "Maya's daughter is named Lena and she is seven years old.",
    "Maya moved from Porto to Berlin in 2019 for a job at a bakery.",
    "Maya is allergic to peanuts and avoids Thai food because of it.",
    "Maya's favourite band is Radiohead; she saw them live in 2017.",
    "Maya runs a half marathon every spring with her brother Tomas.",
    "Maya drives an old blue Volvo that she calls Bertha.",
    "Maya is learning Japanese and practices every morning at six.",
    "Maya's cat, Miso, is a grey British shorthair.",
    "Maya's birthday is on the 14th of March.",
    "Maya works night shifts on Fridays and sleeps in on Saturdays.",
]
QUESTIONS = [
    "How old is my daughter?", "Where did I move in 2019?", "What food do I avoid?",
    "Which band did I see live?", "Who do I run with?", "What do I call my car?",
    "When do I practise Japanese?", "What breed is my cat?", "When is my birthday?",
    "When do I work nights?",
]


def logprob_gap(a: dict[int, float], b: dict[int, float]) -> float:
    """Largest |logprob difference| over the tokens in both top-n lists."""
    common = a.keys() & b.keys()
    return max((abs(a[t] - b[t]) for t in common), default=float("inf"))


def _top1(logprobs: dict[int, float]) -> int:
    return max(logprobs, key=logprobs.get)


def run(mem, user: str = "oracle-bench") -> dict:
    ids = list(mem.add(facts=FACTS, user_id=user).ids)
    k1 = k1_rows(mem, user, ids, QUESTIONS)
    k10 = []
    for q in QUESTIONS:
        text, kv = (mem.chat(q, user_id=user, fact_ids=ids, mode=m, max_tokens=1) for m in ("text", "kv"))
        k10.append({"gap": logprob_gap(text.first_logprobs, kv.first_logprobs),
                    "kl": top20_kl(text.first_logprobs, kv.first_logprobs),
                    "top1_agree": _top1(text.first_logprobs) == _top1(kv.first_logprobs),
                    "fallbacks": kv.fallbacks})
    mem.delete_all(user_id=user)
    return {"model": mem.model.path.name, "k1": k1, "k10": k10, "summary": _summary(k1, k10)}


def k1_rows(mem, user: str, fact_ids: list[str], questions: list[str]) -> list[dict]:
    """Each fact alone, as encoded (after the system prefix): text prefill, the same again (the
    engine's prefix-cache hit: its noise), and KV mode without the reader adapter, whose KV map
    would move injection off text prefill on purpose."""
    rows = []
    for fact_id, q in zip(fact_ids, questions):
        text, cached, kv = (mem.chat(q, user_id=user, fact_ids=[fact_id], mode=m, max_tokens=1, reader=False)
                            for m in ("text", "text", "kv"))
        rows.append({"noise": logprob_gap(text.first_logprobs, cached.first_logprobs),
                     "gap": logprob_gap(text.first_logprobs, kv.first_logprobs),
                     "top1_agree": _top1(text.first_logprobs) == _top1(kv.first_logprobs),
                     "injected_tokens": kv.injected_tokens, "fallbacks": kv.fallbacks})
    return rows


def encode_after_true_prefix(mem, user: str, fact_ids: list[str], messages: list[dict]) -> int:
    """Encode each fact after exactly the tokens that precede it in this chat's prompt, so that
    injecting them all must equal text prefill; -> the prompt's memory tokens (head and facts)."""
    from kvmem.connector.plan import ENCODE, Plan
    from kvmem.encoding import salt
    from kvmem.engine.protocol import EngineRequest

    prompt = mem.prompts.chat([(i, mem.prompts.fact_tokens(mem.get(i).text)) for i in fact_ids], messages)
    mem.engine.run([EngineRequest(prompt.token_ids[: seg.end], salt("encode", user), max_tokens=1,
                                  plan=Plan(ENCODE, (seg,))) for seg in prompt.segments[1:]])
    return prompt.memory_tokens


def _summary(k1: list[dict], k10: list[dict]) -> dict:
    n = len(k1)
    return {
        "k1_max_gap": max(r["gap"] for r in k1),
        "k1_max_noise": max(r["noise"] for r in k1),
        "k1_top1_agree": sum(r["top1_agree"] for r in k1) / n,
        "k1_fallbacks": sum(r["fallbacks"] for r in k1),
        "k10_top1_agree": sum(r["top1_agree"] for r in k10) / len(k10),
        "k10_mean_kl": sum(r["kl"] for r in k10) / len(k10),
        "k10_max_gap": max(r["gap"] for r in k10),
    }


def report(result: dict, out: Path) -> str:
    path = write_json(result, out.with_suffix(".json"))
    s = result["summary"]
    return (f"{result['model']}: k=1 max top-20 logprob gap {s['k1_max_gap']:.4f} (engine prefix-hit noise "
            f"{s['k1_max_noise']:.4f}), top-1 agree {s['k1_top1_agree']:.2f}, fallbacks {s['k1_fallbacks']}; "
            f"k=10 independent: top-1 agree {s['k10_top1_agree']:.2f}, mean KL {s['k10_mean_kl']:.3f}\n"
            f"wrote {path}")
