"""Mem0's metadata filter language, checked where filters enter and compiled to predicates.

A filter is a dict whose entries are all ANDed. An entry is a condition on a metadata key, or a
logical operator over a list of such dicts (each dict's own entries ANDed), nested as deep as
MAX_DEPTH:

    {"user": "ana"}                                   eq, the shorthand
    {"n": {"gte": 1, "lt": 10}}                       every operator of a key must hold
    {"category": "*"}                                 wildcard: the key is there and not null
    {"AND": [{"a": 1}, {"OR": [{"b": 2}, {"c": {"icontains": "x"}}]}]}
    {"NOT": [{"status": "archived"}, {"status": "deleted"}]}   neither of them
    {"NOT": {"tags": {"contains": "spam"}}}           NOT also takes one dict

Operators: eq, ne, in, nin, gt, gte, lt, lte, contains, icontains. Range operators take a
number or a date (ISO-8601 string, `date` or `datetime`); a date bound compares metadata as
datetimes, and metadata that is not a date (or not a number, for a number bound) simply does
not match. `contains` / `icontains` take a string: a substring of a string value, or of any
string in a list value (icontains compares casefolded); other values do not match.
`ne`/`nin` are the exact negations of `eq`/`in`, so a missing key matches them and nothing else
(Mem0: "ne includes NULLs"); NOT is the exact negation of the OR of its dicts. The wildcard is
only the shorthand `{"key": "*"}`; `{"key": {"eq": "*"}}` matches the string "*". Naive
datetimes are taken as UTC so they can be compared with aware ones. AND / OR need a non-empty
list of non-empty dicts (an empty one is almost always a client's bug, and `{"OR": []}` would
quietly match nothing); docs/filters.md has the table.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import date, datetime
from numbers import Real
from typing import Any

from kvmem.errors import InvalidInputError
from kvmem.index.predicates import Condition, Logic, Node, as_datetime, compile_conditions

EQUALITY_OPS = ("eq", "ne")
MEMBERSHIP_OPS = ("in", "nin")
RANGE_OPS = ("gt", "gte", "lt", "lte")
TEXT_OPS = ("contains", "icontains")
OPERATORS = EQUALITY_OPS + MEMBERSHIP_OPS + RANGE_OPS + TEXT_OPS
LOGICAL_KEYS = ("AND", "OR", "NOT")  # so no metadata key of these names can be filtered on
WILDCARD = "*"
MAX_DEPTH = 16  # logical operators inside each other; deeper is refused, not recursed into
SCALARS = (str, Real, type(None), date)  # Real covers bool and numpy numbers; datetime is a date

Filters = tuple[Node, ...]  # ANDed; a flat filter is all Conditions, as before logic came


def validate_filters(filters: Mapping[str, Any] | Filters | None) -> Filters:
    """Check `filters` and return them as conditions; raises InvalidInputError on bad input."""
    if filters is None:
        return ()
    if isinstance(filters, tuple) and all(isinstance(c, (Condition, Logic)) for c in filters):
        return filters  # already validated
    if not isinstance(filters, Mapping):
        raise InvalidInputError(f"filters must be a dict, got {type(filters).__name__}", param="filters")
    return _conjunction(filters, 0)


def _conjunction(filters: Mapping[Any, Any], depth: int) -> Filters:
    """One dict's entries, ANDed, as nodes in the dict's order."""
    nodes: list[Node] = []
    for key, spec in filters.items():
        if key in LOGICAL_KEYS:
            nodes.append(_logic(key, spec, depth + 1))
            continue
        _check_key(key)
        if isinstance(spec, Mapping):
            if not spec:
                raise InvalidInputError(f"filter on {key!r} has no operator", param="filters")
            nodes.extend(_condition(key, op, value) for op, value in spec.items())
        elif isinstance(spec, str) and spec == WILDCARD:
            nodes.append(Condition(key, WILDCARD, None))
        else:
            nodes.append(_condition(key, "eq", spec))
    return tuple(nodes)


def _logic(op: str, spec: Any, depth: int) -> Logic:
    if depth > MAX_DEPTH:
        raise InvalidInputError(f"filters nest AND / OR / NOT deeper than {MAX_DEPTH} levels", param="filters")
    if op == "NOT" and isinstance(spec, Mapping):
        spec = [spec]
    if not isinstance(spec, (list, tuple)) or not spec:
        raise InvalidInputError(f"{op!r} needs a non-empty list of conditions, got {_shown(spec)}",
                                param="filters")
    for item in spec:
        if not isinstance(item, Mapping) or not item:
            raise InvalidInputError(f"{op!r} items must be non-empty dicts of conditions, got {_shown(item)}",
                                    param="filters")
    return Logic(op, tuple(_conjunction(item, depth) for item in spec))


def _shown(value: Any) -> str:
    return repr(value) if isinstance(value, (list, tuple, dict)) and not value else type(value).__name__


def matches(metadata: Mapping[str, Any] | None, filters: Mapping[str, Any] | Filters | None) -> bool:
    """True when `metadata` satisfies every condition in `filters`."""
    return matcher(filters)(metadata)


def matcher(filters: Mapping[str, Any] | Filters | None) -> Callable[[Mapping[str, Any] | None], bool]:
    """`filters` checked once and compiled to a predicate, for testing many metadata dicts."""
    return compile_conditions(validate_filters(filters))


def _check_key(key: Any) -> None:
    if not isinstance(key, str) or not key:
        raise InvalidInputError(f"filter keys must be non-empty strings, got {key!r}", param="filters")


def _condition(key: str, op: Any, value: Any) -> Condition:
    if op not in OPERATORS:
        raise InvalidInputError(
            f"unknown filter operator {op!r} on {key!r}; use one of {', '.join(OPERATORS)}", param="filters"
        )
    if op in RANGE_OPS:
        return Condition(key, op, _range_bound(key, op, value))
    if op in TEXT_OPS:
        if not isinstance(value, str):
            raise InvalidInputError(f"{op!r} on {key!r} needs a string, got {type(value).__name__}",
                                    param="filters")
        return Condition(key, op, value)
    if op in MEMBERSHIP_OPS:
        if not isinstance(value, (list, tuple)):
            raise InvalidInputError(f"{op!r} on {key!r} needs a list, got {type(value).__name__}",
                                    param="filters")
        for item in value:
            _check_scalar(key, op, item)
        return Condition(key, op, tuple(_comparable(item) for item in value))
    _check_scalar(key, op, value)
    return Condition(key, op, _comparable(value))


def _check_scalar(key: str, op: str, value: Any) -> None:
    if isinstance(value, (list, tuple, set)):
        raise InvalidInputError(f"{op!r} on {key!r} needs a single value; to match any of several use 'in'",
                                param="filters")
    if not isinstance(value, SCALARS):
        raise InvalidInputError(
            f"{op!r} on {key!r} needs a str, number, bool, None or date, got {type(value).__name__}", param="filters"
        )


def _range_bound(key: str, op: str, value: Any) -> Real | datetime:
    """A range bound as a number or an aware datetime; anything else is refused."""
    nan = isinstance(value, Real) and value != value
    if isinstance(value, bool) or value is None or nan:
        raise InvalidInputError(f"range operator {op!r} on {key!r} needs a number or a date, got {value!r}",
                                param="filters")
    if isinstance(value, Real):
        return value
    bound = as_datetime(value)
    if bound is None:
        raise InvalidInputError(
            f"range operator {op!r} on {key!r} needs a number or an ISO-8601 date, got {value!r}", param="filters"
        )
    return bound


def _comparable(value: Any) -> Any:
    """Dates become aware datetimes once, here, instead of on every match."""
    return as_datetime(value) if isinstance(value, date) else value
