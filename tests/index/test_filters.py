"""Metadata filters: every operator, dates, missing keys, and every refused input."""

from __future__ import annotations

from datetime import date, datetime, timedelta, timezone

import pytest

from kvmem.errors import InvalidInputError
from kvmem.index.filters import Condition, matches, validate_filters

META = {"user": "ana", "n": 5, "score": 0.5, "flag": True, "tag": None, "when": "2024-03-10T12:00:00"}


@pytest.mark.parametrize(
    "filters, expected",
    [
        ({}, True),
        (None, True),
        ({"user": "ana"}, True),
        ({"user": "bob"}, False),
        ({"user": {"eq": "ana"}}, True),
        ({"user": {"ne": "ana"}}, False),
        ({"user": {"ne": "bob"}}, True),
        ({"user": {"in": ["bob", "ana"]}}, True),
        ({"user": {"in": ["bob"]}}, False),
        ({"user": {"in": []}}, False),
        ({"user": {"nin": ["bob"]}}, True),
        ({"user": {"nin": ["ana", "bob"]}}, False),
        ({"n": 5}, True),
        ({"n": 5.0}, True),
        ({"n": {"gt": 4}}, True),
        ({"n": {"gt": 5}}, False),
        ({"n": {"gte": 5}}, True),
        ({"n": {"lt": 5}}, False),
        ({"n": {"lt": 5.5}}, True),
        ({"n": {"lte": 5}}, True),
        ({"n": {"gte": 1, "lt": 10}}, True),
        ({"n": {"gte": 1, "lt": 5}}, False),
        ({"score": {"gt": 0.25, "lte": 0.5}}, True),
        ({"tag": None}, True),
        ({"tag": {"ne": None}}, False),
        ({"user": "ana", "n": {"gt": 4}}, True),
        ({"user": "ana", "n": {"gt": 5}}, False),
    ],
)
def test_operators(filters, expected):
    assert matches(META, filters) is expected


def test_bool_and_number_are_not_equal():
    # Python has True == 1; a metadata flag must not match a count of 1 (or the reverse).
    assert matches({"flag": True}, {"flag": True})
    assert not matches({"flag": True}, {"flag": 1})
    assert not matches({"n": 1}, {"n": True})
    assert not matches({"n": 1}, {"n": {"in": [True]}})
    assert matches({"n": 1}, {"n": {"nin": [True]}})


def test_range_on_non_numbers_does_not_match():
    assert not matches({"n": "7"}, {"n": {"gt": 1}})
    assert not matches({"n": True}, {"n": {"gte": 0}})
    assert not matches({"n": None}, {"n": {"lt": 1}})
    assert not matches({"n": [3]}, {"n": {"lt": 10}})


@pytest.mark.parametrize(
    "bound, op, expected",
    [
        ("2024-03-01", "gt", True),
        ("2024-03-10T12:00:00", "gte", True),
        ("2024-03-10T12:00:00", "gt", False),
        ("2024-03-10T12:00:01", "lt", True),
        (date(2024, 3, 11), "lt", True),
        (date(2024, 3, 10), "lte", False),  # midnight of the 10th is before noon
        (datetime(2024, 3, 10, 12), "lte", True),
        ("2024-03-10T13:00:00+01:00", "gte", True),  # same instant as 12:00 UTC
        ("2024-03-10T11:00:00Z", "gt", True),
    ],
)
def test_date_ranges(bound, op, expected):
    assert matches(META, {"when": {op: bound}}) is expected


def test_date_metadata_may_be_date_objects_or_strings():
    lo, hi = "2024-01-01", "2024-12-31"
    for value in ("2024-06-01", date(2024, 6, 1), datetime(2024, 6, 1, 8, tzinfo=timezone.utc)):
        assert matches({"d": value}, {"d": {"gte": lo, "lte": hi}})
    assert not matches({"d": "2025-01-01"}, {"d": {"gte": lo, "lte": hi}})


def test_non_date_against_date_bound_is_a_non_match():
    bound = {"d": {"gte": "2024-01-01"}}
    for value in ("yesterday", "", 20240101, None, True, ["2024-05-05"]):
        assert not matches({"d": value}, bound)


def test_aware_and_naive_datetimes_compare():
    now = datetime.now(timezone.utc)
    naive_earlier = (now - timedelta(hours=1)).replace(tzinfo=None)  # naive is taken as UTC
    assert matches({"d": naive_earlier}, {"d": {"lt": now}})
    assert matches({"d": now.isoformat()}, {"d": {"gt": naive_earlier}})


def test_equality_with_a_date_compares_as_datetimes():
    assert matches({"d": "2024-03-10"}, {"d": date(2024, 3, 10)})
    assert matches({"d": "2024-03-10T00:00:00+00:00"}, {"d": {"in": [date(2024, 3, 10)]}})
    assert not matches({"d": "2024-03-11"}, {"d": date(2024, 3, 10)})
    assert matches({"d": "not a date"}, {"d": {"ne": date(2024, 3, 10)}})


def test_missing_keys():
    assert not matches({}, {"user": "ana"})
    assert not matches({}, {"user": {"in": ["ana"]}})
    assert not matches({}, {"n": {"gt": 0}})
    assert not matches({}, {"d": {"lt": "2030-01-01"}})
    # ne/nin are exact negations of eq/in: a fact without the key is "not ana".
    assert matches({}, {"user": {"ne": "ana"}})
    assert matches({}, {"user": {"nin": ["ana"]}})
    assert not matches({}, {"tag": None})  # a missing key is not a key holding None
    assert matches(None, {})


def test_validate_returns_conditions_and_accepts_them_back():
    conds = validate_filters({"user": "ana", "n": {"gte": 1, "lt": 3}, "t": {"in": ["a", "b"]}})
    assert conds == (
        Condition("user", "eq", "ana"),
        Condition("n", "gte", 1),
        Condition("n", "lt", 3),
        Condition("t", "in", ("a", "b")),
    )
    assert validate_filters(conds) is conds
    assert matches({"user": "ana", "n": 2, "t": "b"}, conds)
    assert validate_filters(None) == () and validate_filters({}) == ()


@pytest.mark.parametrize(
    "filters, message",
    [
        (["user", "ana"], "filters must be a dict, got list"),
        ("user=ana", "filters must be a dict, got str"),
        ({"user": {"like": "an%"}}, "unknown filter operator 'like' on 'user'"),
        ({"user": {"$eq": "ana"}}, "unknown filter operator '$eq'"),
        ({"user": {}}, "filter on 'user' has no operator"),
        ({"user": {"in": "ana"}}, "'in' on 'user' needs a list, got str"),
        ({"user": {"nin": 3}}, "'nin' on 'user' needs a list, got int"),
        ({"user": {"in": [["a"]]}}, "'in' on 'user' needs a single value"),
        ({"user": ["ana", "bob"]}, "to match any of several use 'in'"),
        ({"user": {"eq": {"a"}}}, "to match any of several use 'in'"),
        ({"user": {"eq": object()}}, "needs a str, number, bool, None or date, got object"),
        ({"flag": {"gt": True}}, "range operator 'gt' on 'flag' needs a number or a date, got True"),
        ({"n": {"lte": None}}, "range operator 'lte' on 'n' needs a number or a date, got None"),
        ({"n": {"gt": float("nan")}}, "range operator 'gt' on 'n' needs a number or a date, got nan"),
        ({"n": {"lt": "soon"}}, "range operator 'lt' on 'n' needs a number or an ISO-8601 date, got 'soon'"),
        ({"n": {"gte": [1, 2]}}, "range operator 'gte' on 'n' needs a number or an ISO-8601 date"),
        ({"n": {"gte": object()}}, "range operator 'gte' on 'n' needs a number or an ISO-8601 date"),
        ({"": 1}, "filter keys must be non-empty strings"),
        ({3: 1}, "filter keys must be non-empty strings, got 3"),
        ({"OR": []}, "'OR' needs a non-empty list of conditions, got []"),
        ({"AND": {"a": 1}}, "'AND' needs a non-empty list of conditions, got dict"),
        ({"OR": [{"a": 1}, {}]}, "'OR' items must be non-empty dicts of conditions, got {}"),
        ({"NOT": ["a"]}, "'NOT' items must be non-empty dicts of conditions, got str"),
        ({"AND": [{"OR": [{"n": {"gt": "soon"}}]}]}, "range operator 'gt' on 'n' needs a number or an ISO-8601"),
        ({"s": {"contains": 3}}, "'contains' on 's' needs a string, got int"),
    ],
)
def test_invalid_filters(filters, message):
    with pytest.raises(InvalidInputError) as err:
        validate_filters(filters)
    assert message in str(err.value)
    assert (err.value.param, err.value.code) == ("filters", InvalidInputError.INVALID_VALUE)  # the HTTP 400's param
    with pytest.raises(InvalidInputError):  # matches() refuses the same input
        matches({}, filters)
