"""Result types: what the Python API and both memory routes report from them."""

from kvmem.results import AddResult


def test_add_events_name_each_fact_this_call_stored_once_and_the_rest_as_repeats():
    result = AddResult(ids=("a", "b", "a", "c"), created=2, duplicates=2, encode=None, new_ids=("a", "c"))
    assert result.events() == [("a", "ADD"), ("b", "NONE"), ("a", "NONE"), ("c", "ADD")]
    assert result.events("NOOP") == [("a", "ADD"), ("b", "NOOP"), ("a", "NOOP"), ("c", "ADD")]


def test_an_add_that_stored_nothing_reports_no_add():
    assert AddResult(ids=("a",), created=0, duplicates=1, encode=None).events() == [("a", "NONE")]
