"""Mem0's nested filters (AND / OR / NOT, contains, icontains, the "*" wildcard): the engine
against a plain reference, on its own and inside every index that serves a filtered search."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmem.errors import InvalidInputError
from kvmem.index import Condition, ExactIndex, Logic, matcher, matches, validate_filters
from kvmem.index.filters import MAX_DEPTH
from kvmem.index.graph import GraphIndex
from kvmem.index.lexical import LexicalIndex
from kvmem.index.tiered import TieredIndex
from tests.index import filter_reference as ref

SCALE = float(os.environ.get("KVMEM_FUZZ_EXAMPLES", "1"))
DIM = 8


def fuzz(examples: int):
    return settings(max_examples=max(1, int(examples * SCALE)), deadline=None, database=None,
                    derandomize=os.environ.get("KVMEM_FUZZ_RANDOM") != "1",
                    suppress_health_check=[HealthCheck.too_slow])


POOL = ref.pool(300)


@pytest.mark.parametrize("flt", ref.single_conditions(), ids=repr)
def test_every_single_condition_agrees_with_the_reference(flt):
    match = matcher(flt)
    assert [match(meta) for meta in POOL] == [ref.passes(meta, flt) for meta in POOL]


@fuzz(600)
@given(st.lists(ref.metadata, min_size=1, max_size=8), ref.filters)
def test_the_engine_agrees_with_the_reference(metas, flt):
    match = matcher(flt)
    for meta in metas + POOL:
        assert match(meta) is ref.passes(meta, flt), (meta, flt)


@fuzz(150)
@given(st.lists(ref.metadata, min_size=1, max_size=12), st.lists(ref.filters, min_size=1, max_size=3))
def test_every_index_returns_exactly_the_rows_the_reference_passes(drawn, flts):
    metas = drawn + POOL[:60]
    ids = [f"f{i:02d}" for i in range(len(metas))]
    vectors = np.random.default_rng(len(metas)).standard_normal((len(metas), DIM)).astype(np.float32)  # [n, dim]
    dense = [ExactIndex(DIM), GraphIndex(DIM), TieredIndex(DIM)]
    for index in dense:
        index.add("u", ids, vectors, metas)
    lexical = LexicalIndex()
    lexical.add("u", ids, [f"memo number {i}" for i in range(len(ids))], metas)
    for flt in flts:
        want = {i for i, meta in zip(ids, metas) if ref.passes(meta, flt)}
        for _ in range(2):  # the second search is answered from the rows the scope remembers
            for index in dense:
                assert {h.id for h in index.search("u", vectors[0], len(ids), flt)} == want, (type(index), flt)
            assert {h.id for h in lexical.search("u", "memo", len(ids), flt)} == want, flt


MEM0_DOCS = [  # the examples of Mem0's "Memory Filters v2" and "Enhanced Metadata Filtering" pages
    ({"AND": [{"user_id": "u1"}, {"run_id": "*"}]}, ["r"]),
    ({"OR": [{"user_id": "*"}, {"run_id": "*"}]}, ["plain", "r", "null-run", "spam"]),
    ({"AND": [{"user_id": "u1"}, {"NOT": {"categories": {"in": ["spam", "test"]}}}]}, ["plain", "r", "null-run"]),
    ({"NOT": [{"category": "archived"}, {"status": "deleted"}]}, ["plain", "r", "null-run"]),
    ({"AND": [{"agent_id": "*"}, {"agent_id": {"ne": "a1"}}]}, []),
    ({"keywords": {"icontains": "PIZZA"}}, ["r"]),
    ({"tags": {"contains": "urg"}}, ["plain"]),
    ({"AND": [{"OR": [{"category": "work"}, {"category": "personal"}]}, {"priority": {"gte": 5}},
              {"NOT": [{"status": "archived"}]}]}, ["plain"]),
    ({"created_at": {"gte": "2025-01-01T00:00:00Z", "lt": "2025-02-01T00:00:00Z"}}, ["r"]),
]
FACTS = {
    "plain": {"user_id": "u1", "category": "work", "priority": 7, "tags": ["urgent", "q1"]},
    "r": {"user_id": "u1", "run_id": "run1", "keywords": "Pizza on Friday", "created_at": "2025-01-15"},
    "null-run": {"user_id": "u1", "run_id": None, "status": "active"},
    "spam": {"user_id": "u2", "categories": "spam", "category": "archived"},
}


@pytest.mark.parametrize("flt, expected", MEM0_DOCS)
def test_mem0s_documented_examples(flt, expected):
    assert [name for name, meta in FACTS.items() if matches(meta, flt)] == expected
    assert [name for name, meta in FACTS.items() if ref.passes(meta, flt)] == expected


def test_the_flat_form_validates_as_before_and_logic_nests():
    assert validate_filters({"a": 1, "b": {"gt": 2}}) == (Condition("a", "eq", 1), Condition("b", "gt", 2))
    nested = validate_filters({"a": "*", "OR": [{"b": 1}, {"NOT": {"c": {"contains": "x"}}}]})
    assert nested == (
        Condition("a", "*", None),
        Logic("OR", ((Condition("b", "eq", 1),), (Logic("NOT", ((Condition("c", "contains", "x"),),)),))),
    )
    assert validate_filters(nested) is nested and hash(nested) == hash(validate_filters(dict(
        [("a", "*"), ("OR", [{"b": 1}, {"NOT": {"c": {"contains": "x"}}}])])))  # scopes remember rows by it


def test_the_wildcard_is_only_the_shorthand():
    assert matches({"k": "v"}, {"k": "*"}) and not matches({"k": None}, {"k": "*"}) and not matches({}, {"k": "*"})
    assert not matches({"k": "v"}, {"k": {"eq": "*"}}) and matches({"k": "*"}, {"k": {"eq": "*"}})
    assert matches({"k": 0}, {"k": "*"}) and matches({"k": []}, {"k": "*"}) and matches({"k": False}, {"k": "*"})


def test_contains_reads_strings_and_lists_of_strings_only():
    assert matches({"t": "Green Tea"}, {"t": {"contains": "Tea"}})
    assert not matches({"t": "Green Tea"}, {"t": {"contains": "tea"}})
    assert matches({"t": "Green Tea"}, {"t": {"icontains": "TEA"}})
    assert matches({"t": "STRASSE"}, {"t": {"icontains": "straße"}})  # casefolded, not just lowered
    assert matches({"t": ["a", "urgent"]}, {"t": {"contains": "gen"}})
    assert not matches({"t": [1, 2]}, {"t": {"contains": "1"}})
    for value in (12, None, True, {"x": "tea"}):
        assert not matches({"t": value}, {"t": {"icontains": "tea"}})
    assert not matches({}, {"t": {"contains": ""}}) and matches({"t": ""}, {"t": {"contains": ""}})


def test_not_is_the_negation_of_the_or_of_its_dicts():
    for meta in ({}, {"a": 1}, {"b": 2}, {"a": 1, "b": 2}):
        assert matches(meta, {"NOT": [{"a": 1}, {"b": 2}]}) is not matches(meta, {"OR": [{"a": 1}, {"b": 2}]})
        assert matches(meta, {"NOT": [{"a": 1, "b": 2}]}) is not (meta == {"a": 1, "b": 2})


def test_nesting_is_bounded():
    flt: dict = {"a": 1}
    for _ in range(MAX_DEPTH):
        flt = {"NOT": flt}
    assert matches({"a": 1}, flt) is (MAX_DEPTH % 2 == 0)
    with pytest.raises(InvalidInputError, match=f"deeper than {MAX_DEPTH} levels") as err:
        validate_filters({"NOT": flt})
    assert (err.value.param, err.value.code) == ("filters", InvalidInputError.INVALID_VALUE)


@pytest.mark.parametrize("flt, message", [
    ({"NOT": []}, "'NOT' needs a non-empty list of conditions, got []"),
    ({"OR": "a"}, "'OR' needs a non-empty list of conditions, got str"),
    ({"AND": [{"a": 1}, ["b"]]}, "'AND' items must be non-empty dicts of conditions, got list"),
    ({"OR": [{"a": {"icontains": None}}]}, "'icontains' on 'a' needs a string, got NoneType"),
    ({"OR": [{"a": {"like": "x"}}]}, "unknown filter operator 'like' on 'a'"),
    ({"NOT": {"": 1}}, "filter keys must be non-empty strings"),
])
def test_bad_nested_filters_are_refused_with_the_filters_param(flt, message):
    with pytest.raises(InvalidInputError) as err:
        validate_filters(flt)
    assert message in str(err.value)
    assert (err.value.param, err.value.code) == ("filters", InvalidInputError.INVALID_VALUE)
