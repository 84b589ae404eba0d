"""Two services on one PostgreSQL database (two gateways' worth, no engine): each one's indexes
follow the other's writes through the store's change feed. Oracle: a search through the
service that did not write equals a search through the one that did."""

from __future__ import annotations

import time

import pytest

from kvmem.config import Config
from kvmem.service import KVMem

PETS = ["My sister Marta adopted a puppy called Bruno.", "I keep two goldfish named Salt and Pepper.",
        "Our cat Mochi sleeps on the radiator.", "I ride a blue bicycle to the office."]


@pytest.fixture
def pair(tmp_path, model_dir, pg_url):
    def open_one(name, embedder=None):
        config = Config(home=tmp_path / name, models_home=model_dir.parent, database_url=pg_url)
        return KVMem(config, start_engine=False, embedder=embedder)

    a = open_one("a")
    b = open_one("b", a.embedder)
    yield a, b
    b.close()
    a.close()


def _ids(mem, query, user="u", k=10):
    return [h.id for h in mem.search(query, user_id=user, k=k)]


def _converges(reader, writer, query, user="u", timeout=10.0):
    """The reader's ranking equals the writer's within `timeout` (notifications are asynchronous)."""
    deadline = time.monotonic() + timeout
    while _ids(reader, query, user) != _ids(writer, query, user):
        assert time.monotonic() < deadline, f"{query!r}: {_ids(reader, query, user)} != {_ids(writer, query, user)}"
        time.sleep(0.05)
    return _ids(reader, query, user)


def test_adds_updates_and_deletes_through_one_service_reach_the_other(pair):
    a, b = pair
    ids = a.add(facts=PETS, user_id="u", encode="none").ids
    assert _converges(b, a, "What is the puppy called?")[0] == ids[0]
    b.update(ids[1], "I keep three goldfish named Salt, Pepper and Cumin.")
    assert ids[1] in _converges(a, b, "Cumin")[:1]
    a.delete(ids[2])
    assert ids[2] not in _converges(b, a, "Where does the cat sleep?")
    assert b.delete_all(user_id="u") == 3
    assert _converges(a, b, "bicycle") == []


def test_writes_from_both_sides_converge_and_reset_empties_both(pair):
    a, b = pair
    a.add(facts=PETS, user_id="u", encode="none")
    b.add(facts=["I was born in Lisbon."], user_id="w", encode="none")
    _converges(a, b, "Where was I born?", user="w")
    _converges(b, a, "puppy")
    a.reset()
    assert _converges(b, a, "puppy") == [] and _converges(b, a, "born", user="w") == []


def test_the_same_fact_added_through_both_is_stored_once(pair):
    a, b = pair
    first = a.add(facts=["I like jazz."], user_id="u", encode="none")
    again = b.add(facts=["I like jazz."], user_id="u", encode="none")
    assert again.ids == first.ids and again.duplicates == 1
    assert len(b.get_all(user_id="u")) == 1
