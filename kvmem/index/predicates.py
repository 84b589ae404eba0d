"""Validated filter conditions compiled to closures: built once per search, run once per row.

A filtered search calls these for every row of a scope, so the per-row work is kept to a
dict lookup and one comparison: operators are resolved at compile time, `in` lists become
sets, and ISO date strings are parsed through a cache. AND / OR / NOT nodes compile to
closures over their groups' closures, so nesting costs one call per level, not a re-read.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import date, datetime, timezone
from functools import lru_cache
from numbers import Real
from typing import Any


@dataclass(frozen=True)
class Condition:
    """One checked condition. `value` is a tuple for in/nin; dates are held as aware datetimes.

    kvmem.index.filters checks and makes them; the class lives here, beside what runs it, so
    the dependency goes one way: filters imports predicates, never the reverse."""

    key: str
    op: str
    value: Any


@dataclass(frozen=True)
class Logic:
    """AND / OR / NOT over `groups`; each group is one dict of the filter's list, its entries ANDed.

    Frozen and made of tuples, so a whole filter stays hashable: scopes remember the rows passing
    a filter under the filter itself (kvmem.index.remembered)."""

    op: str
    groups: tuple[tuple[Condition | Logic, ...], ...]


Node = Condition | Logic
Predicate = Callable[[Mapping[str, Any]], bool]
Test = Callable[[Any], bool]

# A missing key reads as this sentinel: equal to nothing, in no list, in no range.
_MISSING = object()
_RANGE = {"gt": operator.gt, "gte": operator.ge, "lt": operator.lt, "lte": operator.le}


def compile_conditions(conditions: Iterable[Node]) -> Callable[[Mapping[str, Any] | None], bool]:
    """One predicate that is True when metadata satisfies every condition."""
    pred = _all_of(conditions)
    return lambda metadata: pred(metadata or {})


def _all_of(nodes: Iterable[Node]) -> Predicate:
    preds = [_node(n) for n in nodes]
    if len(preds) == 1:
        return preds[0]

    def match(metadata: Mapping[str, Any]) -> bool:
        for pred in preds:  # a plain loop: all() over a generator costs more per row
            if not pred(metadata):
                return False
        return True

    return match


def _node(node: Node) -> Predicate:
    if isinstance(node, Condition):
        return _predicate(node)
    groups = [_all_of(g) for g in node.groups]

    def any_group(metadata: Mapping[str, Any]) -> bool:
        for group in groups:
            if group(metadata):
                return True
        return False

    if node.op == "OR":
        return any_group
    if node.op == "NOT":  # Mem0's NOT [a, b] keeps what matches neither
        return lambda metadata: not any_group(metadata)
    return _all_of(c for g in node.groups for c in g)  # AND of ANDs is one flat AND


def as_datetime(value: Any) -> datetime | None:
    """`value` (ISO-8601 string, date or datetime) as an aware datetime; None when not a date."""
    if isinstance(value, str):
        return _parse_iso(value)
    if isinstance(value, datetime):
        # Naive is taken as UTC: comparing naive with aware would raise instead of answering.
        return value if value.tzinfo is not None else value.replace(tzinfo=timezone.utc)
    if isinstance(value, date):
        return datetime(value.year, value.month, value.day, tzinfo=timezone.utc)
    return None


@lru_cache(maxsize=65536)
def _parse_iso(text: str) -> datetime | None:
    try:
        return as_datetime(datetime.fromisoformat(text))
    except ValueError:
        return None


def _predicate(cond: Condition) -> Predicate:
    key = cond.key
    if cond.op == "*":  # Mem0's wildcard: the key is there and holds a value
        return lambda meta: meta.get(key) is not None
    if cond.op in ("eq", "ne"):
        test = _equals_test(cond.value)
    elif cond.op in ("in", "nin"):
        test = _member_test(cond.value)
    elif cond.op in ("contains", "icontains"):
        test = _contains_test(cond.value, fold=cond.op == "icontains")
    else:
        test = _range_test(cond.op, cond.value)
    if cond.op in ("ne", "nin"):  # exact negations, so a missing key matches them
        return lambda meta: not test(meta.get(key, _MISSING))
    return lambda meta: test(meta.get(key, _MISSING))


def _equals_test(expected: Any) -> Test:
    if isinstance(expected, datetime):
        return lambda actual: as_datetime(actual) == expected
    is_bool = isinstance(expected, bool)
    # Python says True == 1; a flag and a count are different things in metadata.
    return lambda actual: isinstance(actual, bool) is is_bool and actual == expected


def _member_test(values: tuple[Any, ...]) -> Test:
    dates = [v for v in values if isinstance(v, datetime)]
    keys = {_bool_aware(v) for v in values if not isinstance(v, datetime)}

    def test(actual: Any) -> bool:
        try:
            if _bool_aware(actual) in keys:
                return True
        except TypeError:  # unhashable metadata (a list, a dict) equals no scalar
            return False
        return bool(dates) and as_datetime(actual) in dates

    return test


def _bool_aware(value: Any) -> tuple[bool, Any]:
    """A set key under which True and 1 differ but 1 and 1.0 do not."""
    return (isinstance(value, bool), value)


def _range_test(op: str, bound: Real | datetime) -> Test:
    compare = _RANGE[op]

    def on_dates(actual: Any) -> bool:
        when = as_datetime(actual)
        return when is not None and compare(when, bound)

    def on_numbers(actual: Any) -> bool:
        return isinstance(actual, Real) and not isinstance(actual, bool) and compare(actual, bound)

    return on_dates if isinstance(bound, datetime) else on_numbers


def _contains_test(needle: str, *, fold: bool) -> Test:
    """A substring of a string value, or of any string in a list value (Mem0's tags and categories)."""
    norm = str.casefold if fold else (lambda text: text)
    needle = norm(needle)

    def test(actual: Any) -> bool:
        if isinstance(actual, str):
            return needle in norm(actual)
        if isinstance(actual, list):
            return any(isinstance(item, str) and needle in norm(item) for item in actual)
        return False

    return test
