"""A blob that cannot be used is never injected: the claim stops before it, the answer still comes."""

from __future__ import annotations

import pytest

from kvmem.kv.blob import KVBlob
from tests.helpers import tokens

FACTS = ["Omar keeps bees on his roof.", "Omar's sister Dina lives in Cairo.", "Omar plays the oud on Sundays."]


def _break_missing(mem, fact_id):
    mem.kv.path(fact_id).unlink()


def _break_corrupt(mem, fact_id):
    path = mem.kv.path(fact_id)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # flip bits inside the value tensor: only the checksum can notice
    path.write_bytes(bytes(data))


def _break_stale(mem, fact_id):
    blob = mem.kv.get(fact_id)
    other = KVBlob(fact_id, "0" * 64, blob.token_ids, blob.key, blob.value)
    from kvmem.kv.blob import encode_blob

    mem.kv.path(fact_id).write_bytes(encode_blob(other))  # a valid blob of another model


@pytest.mark.parametrize("breaker,reason", [(_break_missing, "missing"), (_break_corrupt, "corrupt"),
                                            (_break_stale, "stale")])
def test_bad_blob_falls_back_to_text(mem, breaker, reason):
    user = f"fallback-{reason}"
    ids = mem.add(facts=FACTS, user_id=user).ids
    before = mem.stats["fallbacks"]
    breaker(mem, ids[1])

    r = mem.chat("Where does my sister live?", user_id=user, fact_ids=list(ids), mode="kv", max_tokens=16)

    head = len(mem.prompts.head_ids)
    assert r.injected_tokens == head + len(tokens(mem, mem.get(ids[0])))  # stops right before the broken fact
    assert r.fallbacks == 2  # the broken fact and the one after it were prefilled as text
    assert r.fallback_reasons == {ids[1]: reason}
    assert mem.stats["fallbacks"] == before + 2
    assert r.answer
