"""The encoder's bookkeeping, without an engine."""

from kvmem.encoding import Encoder
from kvmem.facts import FactStore, Scope


def test_queue_depth_counts_due_facts_beyond_any_page_size(tmp_path):
    # Regression: queue_depth asked the store for 100,000 rows at once, over its page limit, and raised.
    store = FactStore(tmp_path / "facts.sqlite")
    store.add_many([{"scope": Scope("u"), "text": f"fact {i}"} for i in range(3)])
    encoder = Encoder(engine=None, prompts=None, kv_store=None, fact_store=store, max_attempts=2)
    assert encoder.queue_depth() == 3
    fact_id = store.list(user_id="u")[0].id
    store.set_kv_status(fact_id, "failed")
    store.set_kv_status(fact_id, "failed")  # two attempts: no longer due
    assert encoder.queue_depth() == 2
    store.close()


def test_history_says_whose_fact_it_was_after_delete(tmp_path):
    store = FactStore(tmp_path / "facts.sqlite")
    record, _ = store.add(Scope("owner"), "secret plans")
    store.delete(record.id)
    assert {e.user_id for e in store.history(record.id)} == {"owner"}
    store.close()
