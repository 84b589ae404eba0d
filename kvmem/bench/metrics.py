"""Answer-quality metrics for the LoCoMo evaluation.

Token F1 follows LoCoMo's evaluation: SQuAD-style normalisation (lower case, drop punctuation
and the articles a/an/the, split on whitespace); category 1 (multi-hop) gold answers are split
on commas and scored as the mean, over gold parts, of the best F1 against any comma-separated
part of the prediction; category 3 uses the gold answer before any ';'. Unlike LoCoMo we do not
Porter-stem tokens (no NLTK dependency), which can only lower F1 slightly for both modes alike.
"""

from __future__ import annotations

import math
import random
import re
import statistics
import string
from collections import Counter

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalize(text: str) -> list[str]:
    return _ARTICLES.sub(" ", str(text).lower().translate(_PUNCT)).split()


def token_f1(prediction: str, gold: str) -> float:
    p, g = normalize(prediction), normalize(gold)
    common = sum((Counter(p) & Counter(g)).values())
    if not p or not g or common == 0:
        return float(p == g)
    precision, recall = common / len(p), common / len(g)
    return 2 * precision * recall / (precision + recall)


def locomo_f1(prediction: str, gold, category: int) -> float:
    gold = str(gold)
    if category == 3:
        gold = gold.split(";")[0]
    if category == 1:
        parts = [g for g in gold.split(",") if g.strip()]
        preds = [p for p in prediction.split(",") if p.strip()] or [prediction]
        return sum(max(token_f1(p, g) for p in preds) for g in parts) / max(1, len(parts))
    return token_f1(prediction, gold)


def top20_kl(reference: dict[int, float], other: dict[int, float]) -> float:
    """KL(reference || other) over the reference's top-20 tokens; a token missing from `other`'s
    top-20 gets `other`'s lowest listed logprob (so this is a lower bound on the true KL)."""
    if not reference or not other:
        return math.nan
    floor = min(other.values())
    return sum(math.exp(lp) * (lp - other.get(t, floor)) for t, lp in reference.items())


def first_token(reference: dict, other: dict) -> tuple[bool | None, float]:
    """(same top-1 token, KL(reference || other) over the reference's top 20) of two first-token
    logprob dicts as results logs keep them (token ids as str or int)."""
    ref = {int(t): v for t, v in reference.items()}
    oth = {int(t): v for t, v in other.items()}
    agree = (max(ref, key=ref.get) == max(oth, key=oth.get)) if ref and oth else None
    return agree, top20_kl(ref, oth)


def bootstrap_ci(values: list[float], iters: int = 1000, seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high): the 95% percentile bootstrap interval of the mean."""
    vals = [v for v in values if not math.isnan(v)]
    if not vals:
        return math.nan, math.nan, math.nan
    rng = random.Random(seed)
    means = sorted(sum(rng.choices(vals, k=len(vals))) / len(vals) for _ in range(iters))
    return sum(vals) / len(vals), means[int(0.025 * iters)], means[int(0.975 * iters) - 1]


def ratio_ci(num: list[float], den: list[float], iters: int = 1000, seed: int = 0) -> tuple[float, float, float]:
    """(ratio of means, low, high) with paired bootstrap: for retention = mean(kv gain) / mean(text gain)."""
    pairs = [(a, b) for a, b in zip(num, den) if not (math.isnan(a) or math.isnan(b))]
    if not pairs or sum(b for _, b in pairs) == 0:
        return math.nan, math.nan, math.nan
    rng = random.Random(seed)
    stats = []
    for _ in range(iters):
        sample = rng.choices(pairs, k=len(pairs))
        d = sum(b for _, b in sample)
        stats.append(sum(a for a, _ in sample) / d if d else math.nan)
    stats = sorted(s for s in stats if not math.isnan(s))
    point = sum(a for a, _ in pairs) / sum(b for _, b in pairs)
    return point, stats[int(0.025 * len(stats))], stats[int(0.975 * len(stats)) - 1]


def median_ratio_ci(num: list[float], den: list[float], paired: bool, iters: int = 1000,
                    seed: int = 0) -> tuple[float, float, float]:
    """(median(num) / median(den), low, high): 95% percentile bootstrap.

    paired: num[i] and den[i] were measured together (same facts, same question), so they are
    resampled together; otherwise each list is resampled on its own.
    """
    if not num or not den or (paired and len(num) != len(den)):
        raise ValueError("need two non-empty samples (of equal length when paired)")
    rng = random.Random(seed)
    stats = []
    for _ in range(iters):
        if paired:
            idx = rng.choices(range(len(num)), k=len(num))
            a, b = [num[i] for i in idx], [den[i] for i in idx]
        else:
            a, b = rng.choices(num, k=len(num)), rng.choices(den, k=len(den))
        stats.append(statistics.median(a) / statistics.median(b))
    stats.sort()
    return statistics.median(num) / statistics.median(den), stats[int(0.025 * iters)], stats[int(0.975 * iters) - 1]
