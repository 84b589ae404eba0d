"""Residency routing's two halves against a real Redis: a replica's publisher
(connector/residency.py) summarising its store's RAM tier, and a gateway's view
(engine/residency.py) reading the summaries and ordering replicas by them."""

from __future__ import annotations

import time
import uuid

import pytest
import redis
import torch

from kvmem.connector.residency import ResidencyPublisher
from kvmem.engine.residency import SLOTS, ResidencyView
from kvmem.kv import residency
from kvmem.kv.blob import KVBlob
from kvmem.kv.store import KVStore
from tests.helpers import until

A, B = "http://replica-a:8000", "http://replica-b:8000"


def _blob(fact_id: str, fp: str, n: int = 6) -> KVBlob:
    k, v = (torch.randn(2, n, 1, 8).to(torch.bfloat16) for _ in range(2))
    return KVBlob(fact_id, fp, tuple(range(n)), k, v, 0)


def _until(check, timeout: float = 5.0):
    until(check, timeout, poll_s=0.02)


@pytest.fixture
def fp() -> str:
    return uuid.uuid4().hex * 2  # a model of its own per test: its own summary keys


@pytest.fixture
def store_b(tmp_path, fp):
    """Replica B's store, with facts f1 and f2 in its RAM tier (fetched once after the put)."""
    store = KVStore(tmp_path / "kv", fp)
    for fact in ("f1", "f2"):
        store.put(_blob(fact, fp))
        store.fetch(fact)
    return store


def test_a_replica_publishes_its_ram_tier_and_withdraws_it_when_it_stops(redis_url, fp, store_b):
    publisher = ResidencyPublisher(store_b, redis_url, B + "/", interval_s=0.02)
    client = redis.Redis.from_url(redis_url)
    try:
        _until(lambda: residency.read(client, fp, [A, B], ["f1", "f2", "f3"]).get(B, {}).keys() == {"f1", "f2"})
        assert residency.read(client, fp, [A, B], ["f1"]) == {B: {"f1": store_b.resident()["f1"]}}
        assert 0 < client.ttl(residency.key(fp, B)) <= residency.TTL_S  # a dead replica's summary lapses
        store_b.delete("f1")  # the RAM tier changed: the summary follows
        _until(lambda: residency.read(client, fp, [B], ["f1", "f2"]) == {B: {"f2": store_b.resident()["f2"]}})
    finally:
        publisher.close()
    assert residency.read(client, fp, [B], ["f2"]) == {}


def test_a_gateway_sends_a_chat_where_its_facts_are_unless_that_queue_costs_more(redis_url, fp, store_b):
    publisher = ResidencyPublisher(store_b, redis_url, B, interval_s=0.02)
    view = ResidencyView(redis_url, fp, speculative_ttl_s=0)
    facts = {"f1": 460_800, "f2": 460_800}
    try:
        assert view.order([A, B], {"f9": 460_800}) == [A, B]  # held nowhere: rendezvous order
        _until(lambda: view.order([A, B], facts) == [B, A])
        assert view.order([A, B], {}) == [A, B]  # nothing to inject: rendezvous
        assert view.moved >= 1
        view.queued(B, SLOTS + 3)  # B's own metrics: three chats waiting there
        assert view.order([A, B], facts) == [A, B]
        view.queued(B, 0)
        for _ in range(SLOTS + 3):  # or this gateway's own requests in flight at B
            view.sent(B)
        assert view.order([A, B], facts) == [A, B]
    finally:
        view.close()
        publisher.close()


def test_a_burst_follows_the_first_choice_before_any_summary_shows_it(redis_url, fp):
    view = ResidencyView(redis_url, fp, speculative_ttl_s=60)
    try:
        assert view.order([B, A], {"g1": 1 << 20}) == [B, A]
        # Another user's chat on the same fact: B is assumed to hold it now (its pull is under way).
        assert view.order([A, B], {"g1": 1 << 20}) == [B, A]
        view.forget(B)  # B left the set: nothing more is assumed of it
        assert view.order([A, B], {"g1": 1 << 20}) == [A, B]
    finally:
        view.close()


def test_routing_falls_back_to_rendezvous_at_once_when_redis_is_unreachable(fp):
    view = ResidencyView("redis://127.0.0.1:1", fp)  # nothing listens on port 1
    try:
        start = time.monotonic()
        assert view.order([A, B], {"f1": 1}) == [A, B]
        assert view.order([A, B], {"f1": 1}) == [A, B]  # not asked again for a while
        assert time.monotonic() - start < 1.0
    finally:
        view.close()
