"""Ranking variants for LoCoMo evidence recall, scored offline over a retrieval home.

The "quick harness" of docs/benchmarks.md (Retrieval section): it rebuilds the service's hybrid
scoring from the stored facts (BM25 as kvmem.index.lexical scores it, kvmem.index.fusion.linear,
the eval's novel-hits rule) and reproduces `kvmem eval retrieval --memory both --novel` at
recall@10 (0.829 on the tuning conversations), so a variant is a function of cached arrays and
takes seconds to score. Tuning conversations only: the reporting ones are for `eval retrieval`.

    kvmem --home /tmp/rh-home eval retrieval --data ../shared/data/locomo/locomo_dev.json \
        --conversations conv-26,conv-30,conv-41 --memory both --novel
    .venv/bin/python scripts/retrieval_lab.py --home /tmp/rh-home --work /tmp/rh shipped dense-prf hyde

Prints recall@10 overall and per category (multi-hop, temporal, open-domain, single-hop).
"""

from __future__ import annotations

import argparse
import json
import math
import pickle
from collections import Counter
from pathlib import Path

import numpy as np

from kvmem.bench import locomo
from kvmem.bench.eval_locomo import dia_ids_of
from kvmem.bench.eval_retrieval import novel
from kvmem.config import RetrievalConfig
from kvmem.facts.text import search_text
from kvmem.index.fusion import linear
from kvmem.index.lexical import terms

TUNING = ("conv-26", "conv-30", "conv-41")
SHIPPED = RetrievalConfig()  # the service's fusion weight and depth
HYDE_SYSTEM = "Answer the question in one or two sentences, as the person in the chat would say it."


def build_cache(mem, data: Path) -> dict:
    """Per conversation: the stored facts (vectors, BM25 term counts, sources) and its questions."""
    out = {}
    for conv in locomo.load(data):
        if conv["sample_id"] not in TUNING:
            continue
        recs = mem.get_all(user_id=f"retrieval-{conv['sample_id']}-both-w2", limit=10_000)
        if not recs:
            raise SystemExit(f"no facts for {conv['sample_id']} in this home: run `kvmem eval retrieval` first")
        qs = [(q["question"], q["category"], ev) for q in locomo.questions(conv)
              if (ev := {e.strip() for e in q.get("evidence", []) if isinstance(e, str)})]
        out[conv["sample_id"]] = dict(
            texts=[r.text for r in recs], ctxs=[r.context or "" for r in recs],
            sources=[dia_ids_of(r) for r in recs], session=[r.metadata.get("session") for r in recs],
            stored=np.stack([r.embedding for r in recs]),  # [n, 384], as the index holds them
            counts_full=[Counter(terms(search_text(r.text, r.context))) for r in recs],
            questions=qs, qv=mem.embedder.embed([q for q, _, _ in qs]), qterms=[terms(q) for q, _, _ in qs])
    return out


def bm25(counts: list[Counter], qterms: list[str], k1: float = 1.5, b: float = 0.75) -> np.ndarray:
    """Lucene's BM25 of each fact for the query terms, over all facts (kvmem.index.lexical keeps
    only its top hits; a variant here needs every fact's score)."""
    weights = Counter(qterms)
    lengths = np.array([sum(c.values()) for c in counts], float)  # [n]
    df = Counter(t for c in counts for t in c)
    scores = np.zeros(len(counts))
    for t, w in weights.items():
        if t in df:
            idf = math.log(1 + (len(counts) - df[t] + 0.5) / (df[t] + 0.5))
            tf = np.array([c.get(t, 0) for c in counts], float)
            scores += w * idf * tf * (k1 + 1) / (tf + k1 * (1 - b + b * lengths / lengths.mean()))
    return scores


def fuse(cos: np.ndarray, lex: np.ndarray, w: float = SHIPPED.dense_weight, depth: int = SHIPPED.depth) -> list[int]:
    """The service's linear fusion over the top `depth` of each ranking."""
    cand = sorted(set(np.argsort(-cos)[:depth].tolist()) | {i for i in np.argsort(-lex)[:depth] if lex[i] > 0})
    hits = linear({str(i): float(cos[i]) for i in cand}, {str(i): float(lex[i]) for i in cand}, len(cand), w)
    return [int(h.id) for h in hits]


def evaluate(cache: dict, rank, k: int = 10) -> tuple[float, dict[int, float]]:
    rows = []
    for conv in cache.values():
        for qi, (_, cat, evidence) in enumerate(conv["questions"]):
            sources = [conv["sources"][i] for i in rank(conv, qi)]
            found = set().union(*(sources[i] for i in novel(sources, k)))
            rows.append((cat, len(evidence & found) / len(evidence)))
    return float(np.mean([r for _, r in rows])), {c: float(np.mean([r for cc, r in rows if cc == c])) for c in (1, 2, 3, 4)}


def shipped(conv, qi, qv=None, lex=None):
    qv = conv["qv"][qi] if qv is None else qv
    return fuse(conv["stored"] @ qv, bm25(conv["counts_full"], conv["qterms"][qi]) if lex is None else lex)


def dense_prf(m: int, beta: float):
    """The query moved toward the mean of its top m fused hits (Rocchio)."""
    def rank(conv, qi):
        v = conv["qv"][qi] + beta * conv["stored"][shipped(conv, qi)[:m]].mean(0)
        return shipped(conv, qi, qv=v / np.linalg.norm(v))
    return rank


def hyde_variants(cache: dict, mem, model_path: Path, work: Path) -> dict:
    """Each question answered by the chat model (cached in work/hyde.json); the answer joins
    the query's vector (q + lam x answer) or its BM25 terms."""
    path = work / "hyde.json"
    answers = json.loads(path.read_text()) if path.exists() else {}
    if set(answers) != set(cache):
        answers = {cid: _answers(model_path, [q for q, _, _ in conv["questions"]]) for cid, conv in cache.items()}
        path.write_text(json.dumps(answers))
    for cid, conv in cache.items():
        conv["hv"], conv["hterms"] = mem.embedder.embed(answers[cid]), [terms(a) for a in answers[cid]]

    def dense(lam):
        return lambda c, q: shipped(c, q, qv=(v := c["qv"][q] + lam * c["hv"][q]) / np.linalg.norm(v))

    def lexical(c, q):
        return shipped(c, q, lex=bm25(c["counts_full"], c["qterms"][q] + c["hterms"][q]))
    return {**{f"hyde dense q+{lam}a": dense(lam) for lam in (0.3, 0.5, 1.0)}, "hyde bm25 q+a terms": lexical}


def _answers(model_path: Path, questions: list[str]) -> list[str]:
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    out = []
    for q in tqdm(questions, desc="hypothetical answers", unit="q"):
        msgs = [{"role": "system", "content": HYDE_SYSTEM}, {"role": "user", "content": q}]
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt")
        ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]  # [1, n]
        with torch.no_grad():
            reply = model.generate(ids, max_new_tokens=40, do_sample=False)[0, ids.shape[1]:]
        out.append(tok.decode(reply, skip_special_tokens=True).strip())
    return out


def main() -> None:
    from kvmem.config import Config
    from kvmem.service import KVMem

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("variants", nargs="*", help="shipped (default), dense-prf, hyde")
    ap.add_argument("--home", type=Path, required=True, help="a home `kvmem eval retrieval --memory both` filled")
    ap.add_argument("--data", type=Path, default=Path("../shared/data/locomo/locomo_dev.json"))
    ap.add_argument("--work", type=Path, required=True, help="folder for the caches")
    args = ap.parse_args()
    args.variants = args.variants or ["shipped"]
    if set(args.variants) - {"shipped", "dense-prf", "hyde"}:
        ap.error(f"unknown variants {sorted(set(args.variants) - {'shipped', 'dense-prf', 'hyde'})}")
    args.work.mkdir(parents=True, exist_ok=True)
    with KVMem(Config(home=args.home), start_engine=False, background=False) as mem:
        path = args.work / "cache.pkl"
        cache = pickle.loads(path.read_bytes()) if path.exists() else build_cache(mem, args.data)
        path.write_bytes(pickle.dumps(cache))
        variants = {"shipped": {"shipped": shipped}}
        variants["dense-prf"] = {f"dense PRF m={m} beta={b}": dense_prf(m, b) for m in (3, 5) for b in (0.3, 0.6)}
        if "hyde" in args.variants:
            variants["hyde"] = hyde_variants(cache, mem, mem.model.path, args.work)
        for group in args.variants:
            for name, rank in variants[group].items():
                overall, per = evaluate(cache, rank)
                print(f"{name:32s} {overall:.3f}  " + " ".join(f"{per[c]:.3f}" for c in (1, 2, 3, 4)), flush=True)


if __name__ == "__main__":
    main()
