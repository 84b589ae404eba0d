"""An infer batch on PostgreSQL (two services on one database, no engine): UPDATE and DELETE reach
the other service through the change feed, DELETE forgets, and a fault mid-batch rolls it all back."""

from __future__ import annotations

import time

import pytest

from kvmem.config import Config
from kvmem.errors import UnknownFactError
from kvmem.facts import changes as store_changes
from kvmem.facts.scope import Scope
from kvmem.service import KVMem
from kvmem.writes import Change, apply_changes
from tests.test_service_shared import pair  # noqa: F401 - two stores over one PostgreSQL

FACTS = ["I live in Porto.", "I am vegetarian.", "I ride a blue bicycle to the office."]




def _top(mem, query: str) -> list[str]:
    return [h.id for h in mem.search(query, user_id="u", k=3)]


def _until(check, timeout: float = 30.0) -> None:  # the change feed, on a loaded 2-core CI host
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_update_and_delete_reach_the_other_service(pair):
    a, b = pair
    porto, veg, _ = a.add(facts=FACTS, user_id="u", encode="none").ids
    results, _ = apply_changes(a.writes, [Change("UPDATE", "I moved to Lisbon.", porto), Change("DELETE", fact_id=veg),
                                          Change("ADD", "I have a cat called Mochi.")], Scope("u"), encode="none")
    assert [c.event for c in results] == ["UPDATE", "DELETE", "ADD"]
    assert b.get(porto).text == "I moved to Lisbon." and [e.event for e in b.history(porto)] == ["ADD", "UPDATE"]
    with pytest.raises(UnknownFactError):
        b.get(veg)
    assert [e.event for e in b.history(veg)] == ["ADD", "DELETE"] and b.history(veg)[0].new_text is None
    _until(lambda: _top(b, "Lisbon")[:1] == [porto] and veg not in _top(b, "vegetarian")
           and _top(b, "cat Mochi")[:1] == [results[2].id])


def test_a_fault_mid_batch_rolls_the_whole_batch_back(pair, monkeypatch):
    a, b = pair
    porto, veg, bike = a.add(facts=FACTS, user_id="u", encode="none").ids
    before = [(f.id, f.text, f.updated_at) for f in b.get_all(user_id="u")], b.history(porto), b.history(veg)

    def faulty(*args):
        raise ConnectionError("the database went away mid-batch")

    monkeypatch.setitem(store_changes.STEPS, "DELETE", faulty)
    with pytest.raises(ConnectionError):
        apply_changes(a.writes, [Change("ADD", "I have a cat."), Change("UPDATE", "I moved to Lisbon.", porto),
                                 Change("DELETE", fact_id=veg)], Scope("u"), encode="none")
    for mem in (a, b):
        after = [(f.id, f.text, f.updated_at) for f in mem.get_all(user_id="u")], mem.history(porto), mem.history(veg)
        assert after == before
    assert _top(a, "Lisbon cat")[:3] == _top(b, "Lisbon cat")[:3] and set(_top(a, "Lisbon cat")) <= {porto, veg, bike}
