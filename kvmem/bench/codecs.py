"""`kvmem bench codecs`: each KV codec's size, speed and fidelity, side by side on one engine.

The facts are encoded once, losslessly (codec none); each codec gets a copy of them whose blobs
are re-coded from those originals, so all codecs serve the same KV up to their own rounding. Per codec:
bytes per token, the k=1 oracle gap (a fact injected where it was encoded, against text prefill),
and at k=10 (LoCoMo observations of the tuning conversations, facts and questions drawn at
random) first-token agreement and KL against text prefill and against the lossless blobs, and
KV-mode TTFT. Codecs take turns per prompt, so machine noise hits them alike.
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path

from tqdm import tqdm

from kvmem.bench import locomo
from kvmem.bench.metrics import top20_kl
from kvmem.bench.oracle import FACTS, QUESTIONS, logprob_gap
from kvmem.bench.report import write_json
from kvmem.kv.blob import KVBlob
from kvmem.kv.codec import CODECS, check_codec, encode, role_codecs

USER = "bench-codecs"
TUNING = ("conv-26", "conv-30", "conv-41")


def run(mem, *, data: Path, prompts: int = 60, k: int = 10, seed: int = 0,
        codecs: list[str] | None = None) -> dict:
    """codecs: which to compare (default: all); none always runs first, as the lossless reference."""
    if mem.config.kv.codec != "none":
        raise SystemExit("run this bench with the default codec (none): it re-codes lossless originals")
    chosen_codecs = ["none"] + [check_codec(c) for c in (codecs or CODECS) if c != "none"]
    convs = [c for c in locomo.load(data) if c["sample_id"] in TUNING]
    texts = FACTS + [o.text for c in convs for o in locomo.observations(c)][:200]
    questions = [q["question"] for c in convs for q in locomo.questions(c)]
    users = [USER] + [f"{USER}-{codec}" for codec in chosen_codecs]
    for user in users:
        mem.delete_all(user_id=user)
    ids = list(mem.add(facts=texts, user_id=USER).ids)  # encoded once, losslessly
    originals = [mem.kv.get(fid) for fid in ids]
    rng = random.Random(seed)
    plan = [(rng.sample(range(len(FACTS), len(ids)), k), rng.choice(questions)) for _ in range(prompts)]
    k1_plan = list(zip(range(len(FACTS)), QUESTIONS))
    text_k1 = [_first(mem, USER, q, [ids[i]], "text") for i, q in k1_plan]
    # The same prompts again: vLLM's own prefix-cache hits, the engine's noise floor for k1 gaps
    # (0 where a cache hit is bit-exact; ~0.1 on hosts whose kernels differ, e.g. AMX-bf16).
    cache_noise = max(logprob_gap(t, _first(mem, USER, q, [ids[i]], "text")) for t, (i, q) in zip(text_k1, k1_plan))
    text = [_first(mem, USER, q, [ids[i] for i in chosen], "text")
            for chosen, q in tqdm(plan, desc="text prefill", unit="prompt")]
    rows = {}
    for codec in chosen_codecs:  # none first: the lossless reference for the others
        user, own = _recoded_copy(mem, texts, originals, codec)
        k1 = [_first(mem, user, q, [own[i]], "kv") for i, q in k1_plan]
        kv, ttft = [], []
        for chosen, q in tqdm(plan, desc=f"kv {codec}", unit="prompt"):
            r = mem.chat(q, user_id=user, fact_ids=[own[i] for i in chosen], mode="kv", max_tokens=1)
            kv.append(r.first_logprobs)
            ttft.append(r.ttft_s)
        rows[codec] = _row(codec, originals, text_k1, k1, text, kv, rows.get("none", {}).get("_kv", kv), ttft)
    for user in users:
        mem.delete_all(user_id=user)
    for row in rows.values():
        row.pop("_kv")
    return {"bench": "codecs", "model": mem.model.path.name, "prompts": prompts, "k": k, "seed": seed,
            "conversations": list(TUNING), "time": time.strftime("%Y-%m-%d %H:%M:%S"), "codecs": rows,
            "k1_cache_noise": cache_noise}


def _first(mem, user: str, q: str, fact_ids: list[str], mode: str) -> dict[int, float]:
    return mem.chat(q, user_id=user, fact_ids=fact_ids, mode=mode, max_tokens=1).first_logprobs


def recoded_copy(mem, user: str, texts: list[str], originals: list[KVBlob], codec: str) -> list[str]:
    """The facts again, for `user` alone, with their lossless KV re-coded in `codec`; the copies' ids.

    A user of its own per codec: the prompts stay token for token the same, but vLLM's prefix
    cache (salted per user) cannot hand one codec the blocks another codec's injection left.
    """
    mem.delete_all(user_id=user)
    own = list(mem.add(facts=texts, user_id=user, encode="none").ids)
    keys, values = role_codecs(codec)
    for fact_id, blob in zip(own, originals):
        mem.kv.put(KVBlob(fact_id, blob.fingerprint, blob.token_ids, encode(blob.key, keys),
                          encode(blob.value, values), blob.key_position))
    return own


def _recoded_copy(mem, texts: list[str], originals: list[KVBlob], codec: str) -> tuple[str, list[str]]:
    user = f"{USER}-{codec}"
    own = recoded_copy(mem, user, texts, originals, codec)
    mem.chat(QUESTIONS[0], user_id=user, fact_ids=own[:3], mode="kv", max_tokens=1)  # warm-up, not timed
    return user, own


def _row(codec, originals, text_k1, k1, text, kv, lossless, ttft) -> dict:
    tokens = sum(b.num_tokens for b in originals)
    keys, values = role_codecs(codec)
    nbytes = sum(encode(b.key, keys).nbytes + encode(b.value, values).nbytes for b in originals)
    return {
        "bytes_per_token": nbytes / tokens,
        "k1_max_gap": max(logprob_gap(t, x) for t, x in zip(text_k1, k1)),
        "k1_top1_agree": _agree(text_k1, k1),
        "k10_top1_agree_vs_text": _agree(text, kv),
        "k10_mean_kl_vs_text": statistics.fmean(top20_kl(t, x) for t, x in zip(text, kv)),
        "k10_top1_agree_vs_lossless": _agree(lossless, kv),
        "k10_mean_kl_vs_lossless": statistics.fmean(top20_kl(t, x) for t, x in zip(lossless, kv)),
        "kv_ttft_median_s": statistics.median(ttft),
        "_kv": kv,
    }


def _agree(a: list[dict], b: list[dict]) -> float:
    return sum(max(x, key=x.get) == max(y, key=y.get) for x, y in zip(a, b)) / len(a)


def report(result: dict, out: Path) -> str:
    path = write_json(result, out.with_suffix(".json"))
    lines = [f"{result['model']}, {result['prompts']} prompts at k={result['k']} "
             f"(k1 gap of the engine's own prefix-cache hit: {result.get('k1_cache_noise', 0):.4f}):",
             "codec  B/token  k1 gap  k10 agree/text  KL/text  agree/lossless  KL/lossless  kv TTFT"]
    for codec, r in result["codecs"].items():
        lines.append(f"{codec:6} {r['bytes_per_token']:8,.0f} {r['k1_max_gap']:7.4f} {r['k10_top1_agree_vs_text']:15.3f} "
                     f"{r['k10_mean_kl_vs_text']:8.3f} {r['k10_top1_agree_vs_lossless']:15.3f} "
                     f"{r['k10_mean_kl_vs_lossless']:12.4f} {r['kv_ttft_median_s'] * 1000:6.1f} ms")
    return "\n".join(lines + [f"wrote {path}"])
