"""Random metadata, random nested Mem0 filters, and a plain reference evaluation of them.

The reference reads the filter dict as Mem0's docs describe it and shares no code with
kvmem.index.filters / predicates: the property tests compare the two on the same facts.
"""

from __future__ import annotations

import random
from datetime import date, datetime, timezone

from hypothesis import strategies as st

KEYS = ["a", "b", "c", "d"]  # few keys, so that filters and metadata meet often
WORDS = ["tea", "Tea time", "green TEA", "X", "x", "", "*", "2024-03-10"]  # drawn first-heavy: case first
DAYS = ["2024-01-01", "2024-03-10", "2024-03-10T12:00:00", "2024-03-10T13:00:00+01:00", "2025-06-30T23:59:59Z"]

numbers = st.one_of(st.integers(-3, 3), st.sampled_from([-1.5, 0.0, 0.5, 2.0, 2.5]))
scalars = st.one_of(st.sampled_from(WORDS), numbers, st.booleans(), st.none(), st.sampled_from(DAYS))
values = st.one_of(scalars, st.lists(st.sampled_from(WORDS + [1]), max_size=3))  # lists: tags, categories
metadata = st.dictionaries(st.sampled_from(KEYS), values, max_size=len(KEYS))  # absent keys: missing ones


def single_conditions() -> list[dict]:
    """Every operator with every value it takes, on one key: each leaf, checked one by one."""
    bounds = [*DAYS, -3, -1.5, 0, 0.5, 2, 3]
    scalars_ = [w for w in WORDS if w != "*"] + [*DAYS, -1, 0, 1, 2.5, True, False, None, date(2024, 3, 10)]
    out: list[dict] = [{"a": "*"}, *({"a": v} for v in scalars_)]
    out += [{"a": {op: v}} for op in ("eq", "ne") for v in [*scalars_, "*"]]
    out += [{"a": {op: v}} for op in ("in", "nin") for v in ([], scalars_[:4], scalars_[4:10], scalars_[10:])]
    out += [{"a": {op: v}} for op in ("gt", "gte", "lt", "lte") for v in bounds]
    out += [{"a": {op: v}} for op in ("contains", "icontains") for v in WORDS]
    return out


def pool(n: int, seed: int = 0) -> list[dict]:
    """`n` metadata dicts drawn evenly from the same values: every filter meets a wide mix of them
    (hypothesis's own draws seldom put a word and a case-folding filter on the same key)."""
    rng = random.Random(seed)
    everything = [*WORDS, *DAYS, -3, -1, 0, 1, 2, 3, -1.5, 0.5, 2.5, True, False, None, [], ["x", "Tea time"],
                  ["green TEA", 1], ["*"]]
    return [{k: rng.choice(everything) for k in KEYS if rng.random() < 0.8} for _ in range(n)]

eq_values = st.one_of(scalars.filter(lambda v: v != "*"), st.sampled_from([date(2024, 3, 10), date(2024, 1, 1)]))
ops = st.one_of(
    st.tuples(st.sampled_from(["eq", "ne"]), st.one_of(eq_values, st.just("*"))),
    st.tuples(st.sampled_from(["in", "nin"]), st.lists(eq_values, max_size=3)),
    st.tuples(st.sampled_from(["gt", "gte", "lt", "lte"]), st.one_of(numbers, st.sampled_from(DAYS))),
    st.tuples(st.sampled_from(["contains", "icontains"]), st.sampled_from(WORDS)),
)
key_specs = st.one_of(eq_values, st.just("*"), ops.map(lambda op: dict([op])),  # two ops on a key seldom both hold
                      st.lists(ops, min_size=2, max_size=2).map(dict))
leaves = st.dictionaries(st.sampled_from(KEYS), key_specs, min_size=1, max_size=2)


def _logical(children):
    groups = st.lists(children, min_size=1, max_size=3)
    return st.one_of(
        st.builds(lambda g: {"AND": g}, groups),
        st.builds(lambda g: {"OR": g}, groups),
        st.builds(lambda g: {"NOT": g}, groups),
        st.builds(lambda g: {"NOT": g}, children),  # NOT of one dict, not in a list
        st.builds(lambda g, extra: {**extra, "OR": g}, groups, leaves),  # logic beside plain keys
    )


# Big random trees are mostly constant (one leaf seldom decides them), so small ones come too.
filters = st.one_of(leaves, st.recursive(leaves, _logical, max_leaves=3), st.recursive(leaves, _logical, max_leaves=8))


# -- the reference ------------------------------------------------------------------------------

def passes(meta: dict, flt: dict) -> bool:
    """Every entry of the dict holds."""
    return all(_entry(meta, key, spec) for key, spec in flt.items())


def _entry(meta: dict, key: str, spec) -> bool:
    if key == "AND":
        return all(passes(meta, g) for g in spec)
    if key == "OR":
        return any(passes(meta, g) for g in spec)
    if key == "NOT":
        return not any(passes(meta, g) for g in ([spec] if isinstance(spec, dict) else spec))
    if isinstance(spec, str) and spec == "*":
        return meta.get(key) is not None
    if isinstance(spec, dict):
        return all(_op(meta, key, op, want) for op, want in spec.items())
    return _op(meta, key, "eq", spec)


def _op(meta: dict, key: str, op: str, want) -> bool:
    if op == "ne":
        return not _op(meta, key, "eq", want)
    if op == "nin":
        return not _op(meta, key, "in", want)
    if key not in meta:
        return False
    have = meta[key]
    if op == "eq":
        return _same(have, want)
    if op == "in":
        return any(_same(have, w) for w in want)
    if op in ("contains", "icontains"):
        fold = str.casefold if op == "icontains" else str
        texts = [have] if isinstance(have, str) else [t for t in have if isinstance(t, str)] \
            if isinstance(have, list) else []
        return any(fold(want) in fold(t) for t in texts)
    return _in_range(have, op, want)


def _same(have, want) -> bool:
    if isinstance(want, date):
        return _when(have) is not None and _when(have) == _when(want)
    if isinstance(have, (list, dict)):
        return False
    return isinstance(have, bool) == isinstance(want, bool) and have == want


def _in_range(have, op: str, bound) -> bool:
    if isinstance(bound, str):  # a date bound: only dates compare
        have, bound = _when(have), _when(bound)
        if have is None:
            return False
    elif isinstance(have, bool) or not isinstance(have, (int, float)):
        return False
    return {"gt": have > bound, "gte": have >= bound, "lt": have < bound, "lte": have <= bound}[op]


def _when(value) -> datetime | None:
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            return None
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=timezone.utc)
    if isinstance(value, date):
        return datetime(value.year, value.month, value.day, tzinfo=timezone.utc)
    return None
