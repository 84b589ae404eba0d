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
           "vectors": mem.index.count("restart"),
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
