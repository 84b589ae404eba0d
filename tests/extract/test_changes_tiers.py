"""An infer batch's DELETE on the KV tiers (no engine): the local blob and the shared Redis tier
forget it as a delete does."""

from __future__ import annotations

from kvmem.config import Config, KVConfig
from kvmem.facts.scope import Scope
from kvmem.kv.shared import SharedTier
from kvmem.service import KVMem
from kvmem.writes import Change, apply_changes
from tests.kv.test_blob import make_blob


def test_a_delete_decided_by_infer_forgets_the_blob_in_the_redis_tier_too(tmp_path, model_dir, redis_url):
    """Every store: the local blob file and the shared Redis tier (read as another process would),
    beside the fact, its history words and both indexes; the other fact's blob stays."""
    config = Config(home=tmp_path / "home", models_home=model_dir.parent, kv=KVConfig(shared_url=redis_url))
    with KVMem(config, start_engine=False) as mem:
        keep, gone = mem.add(facts=["The spare key is under the mat.", "The door code is 4512."], user_id="u",
                             encode="none").ids
        for fact_id in (keep, gone):
            mem.kv.put(make_blob(fact_id, fp=mem.model.fingerprint))
        tier = SharedTier(redis_url, mem.model.fingerprint)
        assert tier.stamp(gone) is not None
        results, _ = apply_changes(mem.writes, [Change("DELETE", fact_id=gone)], Scope("u"), encode="none")
        assert [(c.event, c.id) for c in results] == [("DELETE", gone)]
        assert [(e.event, e.source) for e in mem.history(gone)] == [("ADD", None), ("DELETE", "infer")]
        assert not mem.kv.path(gone).exists() and tier.stamp(gone) is None and not mem.kv.exists(gone)
        assert gone not in mem.retrieval.lexical.scores("u", "door code")
        assert [h.id for h in mem.retrieval.dense.search("u", mem.embedder.embed(["door code"])[0], 10)] == [keep]
        assert tier.stamp(keep) is not None and mem.kv.exists(keep)
        tier.close()
