"""The chat x-ray's ring (trace.py): bounded per scope and in scopes, and each fact's way in."""

from __future__ import annotations

import tracemalloc

from kvmem.trace import ChatTrace, FactTrace, TraceRing, served


def _trace(i: int, user: str) -> ChatTrace:
    fact = FactTrace(f"f-{i}", "x" * 200, 0.5, "kv", None, 12)
    return ChatTrace(f"chat-{i}", user, None, None, float(i), "kv", "q" * 200, (fact,) * 5, 100, 60, 1.0, 0.1)


def test_ten_thousand_chats_keep_the_ring_at_its_bound():
    ring = TraceRing(per_scope=8, scopes=4)
    tracemalloc.start()
    for i in range(200):
        ring.record(_trace(i, f"u{i % 4}"))
    settled = tracemalloc.get_traced_memory()[0]
    for i in range(200, 10_000):
        ring.record(_trace(i, f"u{i % 4}" if i % 100 else f"new-{i}"))  # now and then a new scope
    grown = tracemalloc.get_traced_memory()[0] - settled
    tracemalloc.stop()
    assert len(ring) == 8 * 4
    assert grown < 64 * 1024, grown  # the same 32 traces' worth, whatever the count of chats
    assert [t.id for t in ring.recent("u3")][:2] == ["chat-9999", "chat-9995"]  # newest first
    assert ring.get("chat-9999") is not None and ring.get("chat-5") is None


def test_the_least_recently_used_scope_goes_first():
    ring = TraceRing(per_scope=2, scopes=2)
    ring.record(_trace(1, "a"))
    ring.record(_trace(2, "b"))
    ring.record(_trace(3, "a"))  # a is used again
    ring.record(_trace(4, "c"))  # b goes
    assert ring.recent("b") == [] and [t.id for t in ring.recent("a")] == ["chat-3", "chat-1"]


def test_a_ring_of_zero_keeps_nothing():
    ring = TraceRing(per_scope=0)
    ring.record(_trace(1, "a"))
    assert len(ring) == 0 and ring.get("chat-1") is None


def test_each_fact_says_how_it_went_in():
    ids = ["a", "b", "c", "d"]
    # planned: 3 facts to inject (the 4th is a text fact); the connector injected the first one,
    # b's blob was missing, c came after it, d was asked as text.
    assert served(ids, "kv", 3, 1, {"b": "missing"}) == [("kv", None), ("text", "missing"), ("text", "after_text"),
                                                         ("text", "text_facts")]
    assert served(ids[:2], "text", 0, 0, {}) == [("text", "mode"), ("text", "mode")]
