"""The disk tier under a per-user quota, end to end on the session's engine: a restart enforces
the quota, an evicted fact is served by text while the others are still injected, a fact that
chats keep using is re-encoded and injected again, and other users are untouched."""

from dataclasses import replace

import pytest

from kvmem.service import KVMem

ALICE = ["Alice keeps bees on the roof of her flat.", "Alice's brother Tom plays the cello.",
         "Alice ran the Berlin marathon in May."]


@pytest.fixture
def open_home(mem, tmp_path):
    """KVMem instances with their own fact store on the session's engine (blobs in its folder)."""
    opened = []

    def open_(**kv) -> KVMem:
        config = replace(mem.config, home=tmp_path / "home", kv_root=mem.config.kv_dir, kv=replace(mem.config.kv, **kv))
        m = KVMem(config, engine=mem.engine, embedder=mem.embedder)
        opened.append(m)
        return m

    yield open_
    for m in opened:
        m.close()


def blob_bytes(m: KVMem, fact_id: str) -> int:
    return m.kv.stamp(fact_id)[1]


def test_quota_evicts_serves_text_and_brings_hot_facts_back(open_home):
    m = open_home()
    alice = list(m.add(facts=ALICE, user_id="tier-alice").ids)
    (bob,) = m.add(facts=["Bob collects stamps."], user_id="tier-bob").ids
    sizes = sorted(blob_bytes(m, f) for f in alice)
    m.close()

    quota = sizes[1] + sizes[2]  # room for any two of alice's blobs, never three
    m = open_home(tenant_quota_mib=quota / (1 << 20))
    status = {f: m.get(f).kv_status for f in alice}
    (evicted,) = [f for f, s in status.items() if s == "evicted"]
    assert not m.kv.exists(evicted) and m.keeper.budget.tenant_bytes("tier-alice") <= quota
    assert m.get(bob).kv_status == "encoded" and m.kv.exists(bob)  # under its own quota

    # Retrieval puts the two facts with KV first, so only the evicted one is text.
    r = m.chat("What do you know about Alice?", user_id="tier-alice", k=3, max_tokens=2)
    assert set(r.fact_ids) == set(alice) and r.fact_ids[-1] == evicted
    assert r.fallback_reasons == {evicted: "missing"} and r.fallbacks == 1 and r.injected_tokens > 0
    assert m.kv_tiers()["readmissions"] == 0  # used once, like the blobs it would displace

    r = m.chat("Where are the bees?", user_id="tier-alice", fact_ids=[evicted], max_tokens=2)
    assert r.fallbacks == 1 and m.kv_tiers()["readmissions"] == 1  # now used more than the others
    assert m.encode_pending(timeout=120)
    assert m.get(evicted).kv_status == "encoded" and m.kv.exists(evicted)
    assert sum(m.get(f).kv_status == "evicted" for f in alice) == 1  # another one made room
    assert m.keeper.budget.tenant_bytes("tier-alice") <= quota

    # Another fact after it, so that the engine's own prefix cache (filled by the last chat, which
    # computed this fact as text) does not cover the prompt and the blob is what serves it.
    other = next(f for f in alice if f != evicted and m.get(f).kv_status == "encoded")
    r = m.chat("Where are the bees?", user_id="tier-alice", fact_ids=[evicted, other], max_tokens=2)
    assert r.fallbacks == 0 and r.injected_tokens > 0
    tiers = m.kv_tiers()
    assert tiers["evictions"] == 2 and tiers["disk_misses"] == 2 and tiers["disk_hits"] == 4
    assert tiers["ram_hits"] + tiers["ram_misses"] >= 6  # each injected blob: from RAM or from disk


def test_forgetting_an_evicted_fact_and_deleting_a_user_return_the_bytes(open_home):
    m = open_home(tenant_quota_mib=0)  # a quota of nothing: every blob is evicted once written
    ids = m.add(facts=ALICE[:2], user_id="tier-zero").ids
    assert all(m.get(f).kv_status == "evicted" for f in ids) and m.keeper.budget.tenant_bytes("tier-zero") == 0
    r = m.chat("Who plays the cello?", user_id="tier-zero", k=2, max_tokens=2)
    assert r.fallbacks == 2 and m.kv_tiers()["readmissions"] == 0  # can never fit: not re-encoded
    m.delete(ids[0])
    assert m.delete_all(user_id="tier-zero") == 1 and len(m.keeper.budget) == 0


def test_a_restart_with_a_smaller_quota_evicts_the_least_used_not_the_oldest(open_home):
    m = open_home()
    ids = list(m.add(facts=ALICE, user_id="tier-restart").ids)
    sizes = sorted(blob_bytes(m, f) for f in ids)
    for _ in range(2):  # the oldest two are used, the newest is not
        m.chat("Tell me about Alice.", user_id="tier-restart", fact_ids=ids[:2], max_tokens=1)
    m.close()
    m = open_home(tenant_quota_mib=(sizes[1] + sizes[2]) / (1 << 20))
    assert [m.get(f).kv_status for f in ids] == ["encoded", "encoded", "evicted"]


def test_a_blobs_uses_are_live_and_its_codec_is_its_own(open_home):
    """What /ui shows of a fact's blob: the chats that injected it so far (not as of the last
    close) and the codec it was written with (not the one configured since)."""
    m = open_home()
    (fact,) = m.add(facts=["Alice's kayak is red."], user_id="tier-uses").ids
    for _ in range(2):
        assert m.chat("What colour is my kayak?", user_id="tier-uses", fact_ids=[fact], max_tokens=2).fallbacks == 0
    assert m.blob(fact).uses == 2 and m.blob(fact).codec == "none"
    m.close()
    m = open_home(codec="int8")
    assert m.blob(fact).codec == "none" and m.blob(fact).uses == 2  # the saved count, read back
