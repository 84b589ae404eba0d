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
