"""Restart safety: a new process sees every fact, vector and blob; lost blobs are re-encoded."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from kvmem.service import KVMem

FACTS = ["I grew up in Valparaíso.", "My first job was at a fish market.", "I have two kids, Ana and Teo.",
         "I collect vintage cameras.", "My partner is a jazz pianist."]
QUERIES = ["Where did I grow up?", "What do I collect?", "Who are my children?"]

PROBE = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from kvmem.config import Config
    from kvmem.service import KVMem
    config = Config(home=Path(sys.argv[1]), models_home=Path(sys.argv[2]))
    mem = KVMem(config, start_engine=False)  # a fresh process: no engine needed to search
    out = {"search": {q: [[h.id, round(h.score, 6)] for h in mem.search(q, user_id="restart", k=3)] for q in json.loads(sys.argv[3])},
           "facts": sorted(f.id for f in mem.get_all(user_id="restart")),
           "vectors": mem.retrieval.dense.count("restart"),
           "blobs": sorted(f.id for f in mem.get_all(user_id="restart") if mem.kv.exists(f.id))}
    print(json.dumps(out))
    mem.close()
""")


def test_a_new_process_sees_facts_vectors_blobs_and_identical_search(mem):
    ids = mem.add(facts=FACTS, user_id="restart").ids
    before = {q: [[h.id, round(h.score, 6)] for h in mem.search(q, user_id="restart", k=3)] for q in QUERIES}
    run = subprocess.run([sys.executable, "-c", PROBE, str(mem.config.home), str(mem.config.models_dir), json.dumps(QUERIES)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    after = json.loads(run.stdout.strip().splitlines()[-1])
    assert after["search"] == before
    assert after["facts"] == sorted(ids) and after["vectors"] == len(FACTS) and after["blobs"] == sorted(ids)


BESIDE = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from kvmem.config import Config
    from kvmem.service import KVMem
    with KVMem(Config(home=Path(sys.argv[1]), models_home=Path(sys.argv[2])), start_engine=False) as mem:
        print(json.dumps(sorted(f.id for f in mem.get_all(user_id=sys.argv[3], limit=1000))))
""")


def beside(mem, user_id: str) -> list[str]:
    """The ids a second process (a CLI next to the running service) lists for `user_id`."""
    run = subprocess.run([sys.executable, "-c", BESIDE, str(mem.config.home), str(mem.config.models_dir), user_id],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_a_second_process_beside_the_running_service_leaves_its_facts_file_working(mem):
    """Regression: a read of facts.sqlite in the serving process (tests/test_service.py once did
    one) dropped SQLite's POSIX locks there; a second process then deleted the -wal and -shm files
    on closing, and the service's next connection failed with "disk I/O error" (this file, run
    after test_service.py). The store now holds a lock no such close can drop (facts/sqlite.py)."""
    first = list(mem.add(facts=["I keep bees on the roof."], user_id="beside", encode="none").ids)
    (mem.config.home / "facts.sqlite").read_bytes()  # opens and closes the file in this process
    assert beside(mem, "beside") == first
    more = list(mem.add(facts=[f"Hive {i} faces south." for i in range(50)], user_id="beside", encode="none").ids)
    try:
        reopened = KVMem(mem.config, engine=mem.engine, background=False)  # a second connection of this process
        try:
            assert sorted(f.id for f in reopened.get_all(user_id="beside", limit=1000)) == sorted(first + more)
        finally:
            reopened.close()
        assert beside(mem, "beside") == sorted(first + more)
    finally:
        mem.delete_all(user_id="beside")  # leaves no unencoded facts to the session's other tests


def test_a_lost_blob_is_served_as_text_then_re_encoded_in_the_background(mem):
    ids = mem.add(facts=["My boat is called Saudade.", "I sail every Sunday."], user_id="relost").ids
    mem.kv.path(ids[0]).unlink()  # e.g. the KV folder was wiped while we were down

    reopened = KVMem(mem.config, engine=mem.engine, background=False)  # same data, "restarted" service
    try:
        assert reopened.get(ids[0]).kv_status == "pending"  # noticed at start-up
        r = reopened.chat("What is my boat called?", user_id="relost", fact_ids=list(ids), mode="kv", max_tokens=8)
        assert r.fallbacks == 2 and r.answer  # served by text prefill meanwhile
        reopened.encoder.start()
        assert reopened.encode_pending(timeout=300)
        assert reopened.kv.exists(ids[0]) and reopened.get(ids[0]).kv_status == "encoded"
        r = reopened.chat("What is my boat called?", user_id="relost", fact_ids=list(ids), mode="kv", max_tokens=8)
        assert r.fallbacks == 0
    finally:
        reopened.close()


def test_the_rebuilt_index_keeps_agents_runs_and_metadata_filters(tmp_path):
    """Oracle: every scoped and filtered search answers the same after a reopen (no engine)."""
    from kvmem.config import Config, default_home

    config = Config(home=tmp_path, models_home=default_home() / "models")
    searches = [dict(user_id="u"), dict(user_id="u", agent_id="a1"), dict(user_id="u", agent_id="a1", run_id="r1"),
                dict(user_id="u", filters={"topic": "food"}), dict(user_id="v")]

    def answers(mem):
        return [[(h.id, round(h.score, 6)) for h in mem.search("what do I eat", k=10, **s)] for s in searches]

    with KVMem(config, start_engine=False) as mem:
        mem.add(facts=["I eat rice daily.", "I swim on Mondays."], user_id="u", encode="none")
        mem.add(facts=["I eat figs."], user_id="u", agent_id="a1", metadata={"topic": "food"}, encode="none")
        mem.add(facts=["I eat late."], user_id="u", agent_id="a1", run_id="r1", encode="none")
        mem.add(facts=["I eat soup."], user_id="v", metadata={"topic": "food"}, encode="none")
        before = answers(mem)
    with KVMem(config, start_engine=False) as mem:
        assert answers(mem) == before
    assert [len(b) for b in before] == [4, 2, 1, 1, 1]


def test_every_bad_blob_is_found_by_one_chat_and_at_start_up(mem):
    """Four broken blobs: one KV chat re-queues all four (it was one per chat); a restart marks
    zero-length and swapped ones pending instead of 'encoded'."""
    texts = ["My boat is called Saudade.", "I sail every Sunday.", "My dog is called Pico.",
             "I live in Lisbon.", "I work as a luthier."]
    ids = list(mem.add(facts=texts, user_id="repair").ids)
    keep = mem.kv.path(ids[4]).read_bytes()
    mem.kv.path(ids[1]).write_bytes(b"")
    mem.kv.path(ids[2]).write_bytes(mem.kv.path(ids[3]).read_bytes())  # another fact's blob
    mem.kv.path(ids[3]).write_bytes(keep)
    raw = bytearray(mem.kv.path(ids[4]).read_bytes())
    raw[-1] ^= 0xFF  # same size, so only the checksum can tell
    mem.kv.path(ids[4]).write_bytes(bytes(raw))

    reopened = KVMem(mem.config, engine=mem.engine, background=False)
    try:
        statuses = [reopened.get(i).kv_status for i in ids]
        assert statuses == ["encoded", "pending", "pending", "pending", "encoded"]  # the flip needs the checksum
        r = reopened.chat("What is my boat called?", user_id="repair", fact_ids=ids, mode="kv", max_tokens=4)
        assert set(r.fallback_reasons) == set(ids[1:]) and r.fallbacks == 4
        assert [reopened.get(i).kv_status for i in ids] == ["encoded"] + ["pending"] * 4
        report = reopened.encoder.encode(reopened.facts.pending(limit=10, max_attempts=3))
        assert report.encoded == 4 and report.failed == ()
        assert all(reopened.encoder.blob_ok(i) for i in ids)
        r = reopened.chat("What is my boat called?", user_id="repair", fact_ids=ids, mode="kv", max_tokens=4)
        assert r.fallbacks == 0
    finally:
        reopened.close()
