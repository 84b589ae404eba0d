"""Mem0-style metadata filters: `{"key": value}` or `{"key": {"op": value, ...}}`, all ANDed.

Operators: eq, ne, in, nin, gt, gte, lt, lte. Range operators take a number or a date
(ISO-8601 string, `date` or `datetime`); a date bound compares metadata as datetimes, and
metadata that is not a date (or not a number, for a number bound) simply does not match.
`ne`/`nin` are the exact negations of `eq`/`in`, so a missing key matches them and nothing else.
Naive datetimes are taken as UTC so they can be compared with aware ones.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import date, datetime
from numbers import Real
from typing import Any

from kvmem.errors import InvalidInputError
from kvmem.index.predicates import Condition, as_datetime, compile_conditions

EQUALITY_OPS = ("eq", "ne")
MEMBERSHIP_OPS = ("in", "nin")
RANGE_OPS = ("gt", "gte", "lt", "lte")
OPERATORS = EQUALITY_OPS + MEMBERSHIP_OPS + RANGE_OPS
LOGICAL_KEYS = ("AND", "OR", "NOT")  # Mem0 has them; we refuse rather than misread them as keys
SCALARS = (str, Real, type(None), date)  # Real covers bool and numpy numbers; datetime is a date

Filters = tuple[Condition, ...]


def validate_filters(filters: Mapping[str, Any] | Filters | None) -> Filters:
    """Check `filters` and return them as conditions; raises InvalidInputError on bad input."""
    if filters is None:
        return ()
    if isinstance(filters, tuple) and all(isinstance(c, Condition) for c in filters):
        return filters  # already validated
    if not isinstance(filters, Mapping):
        raise InvalidInputError(f"filters must be a dict, got {type(filters).__name__}", param="filters")
    conditions: list[Condition] = []
    for key, spec in filters.items():
        _check_key(key)
        if isinstance(spec, Mapping):
            if not spec:
                raise InvalidInputError(f"filter on {key!r} has no operator", param="filters")
            conditions.extend(_condition(key, op, value) for op, value in spec.items())
        else:
            conditions.append(_condition(key, "eq", spec))
    return tuple(conditions)


def matches(metadata: Mapping[str, Any] | None, filters: Mapping[str, Any] | Filters | None) -> bool:
    """True when `metadata` satisfies every condition in `filters`."""
    return matcher(filters)(metadata)


def matcher(filters: Mapping[str, Any] | Filters | None) -> Callable[[Mapping[str, Any] | None], bool]:
    """`filters` checked once and compiled to a predicate, for testing many metadata dicts."""
    return compile_conditions(validate_filters(filters))


def _check_key(key: Any) -> None:
    if not isinstance(key, str) or not key:
        raise InvalidInputError(f"filter keys must be non-empty strings, got {key!r}", param="filters")
    if key in LOGICAL_KEYS:
        raise InvalidInputError(f"logical operator {key!r} is not supported; top-level conditions are ANDed",
                                param="filters")


def _condition(key: str, op: Any, value: Any) -> Condition:
    if op not in OPERATORS:
        raise InvalidInputError(
            f"unknown filter operator {op!r} on {key!r}; use one of {', '.join(OPERATORS)}", param="filters"
        )
    if op in RANGE_OPS:
        return Condition(key, op, _range_bound(key, op, value))
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
