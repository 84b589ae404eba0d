"""The encoder's bookkeeping, and its leases under a write burst (on the session's engine)."""

import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

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


class _CountingEngine:
    """The session's real engine, counting the ENCODE requests it is sent per fact (what a replica
    would count): the measure of duplicate encodes, not a stand-in for the engine."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.sent: Counter[str] = Counter()
        self._lock = threading.Lock()

    def encode(self, requests) -> None:
        with self._lock:
            self.sent.update(s.fact_id for r in requests for s in r.plan.segments)
        self.engine.encode(requests)


def _burst(engine, stores, encoders) -> tuple[int, int]:
    """16 writers, 4 facts each, through stores[i % n]: half encode at once (sync), half kick the
    background loops, which all run. -> (facts, duplicate encodes), once every loop is idle."""
    for encoder in encoders:
        encoder.start()

    def write(i: int) -> list[str]:
        store, encoder = stores[i % len(stores)], encoders[i % len(encoders)]
        added = [r for r, _ in store.add_many([{"scope": Scope(f"burst-{i}"), "text": f"Burst {i}: fact {j}."}
                                               for j in range(4)])]
        if i % 4 < 2:
            assert not encoder.encode(added).failed
        else:
            encoder.kick()
        return [r.id for r in added]

    with ThreadPoolExecutor(8) as pool:
        ids = [fact for batch in pool.map(write, range(16)) for fact in batch]
    for _ in range(3):  # each loop idle, then once more: a loop may claim what another left
        assert all(encoder.wait_idle(300) for encoder in encoders)
    assert {stores[0].get(f).kv_status for f in ids} == {"encoded"}
    counts = [engine.sent[f] for f in ids]
    print(f"\n{len(ids)} facts, {sum(counts)} encodes")
    assert min(counts) >= 1  # each blob was made by an encode, not found already there
    return len(ids), sum(n - 1 for n in counts)


def test_two_encoders_over_one_postgres_encode_a_write_burst_once(mem, pg_url):
    """Two gateways' encoders (each with its own PgFactStore, as two processes have) under a write
    burst through both, each loop seeing the other's pending facts: each fact is encoded once
    (before leases: 148 encodes of 64 facts, 84 of them duplicates)."""
    from kvmem.facts.pg import PgFactStore

    engine = _CountingEngine(mem.engine)
    stores = [PgFactStore(pg_url) for _ in range(2)]
    encoders = [Encoder(engine, mem.prompts, mem.kv, store) for store in stores]
    try:
        assert _burst(engine, stores, encoders)[1] == 0
    finally:
        for encoder in encoders:
            encoder.stop()
        for store in stores:
            store.close()


def test_one_process_on_sqlite_encodes_a_write_burst_once(mem, tmp_path):
    """SQLite's one process: its sync writes and its background loop never encode one fact twice
    (before leases: 76 encodes of 64 facts)."""
    engine = _CountingEngine(mem.engine)
    store = FactStore(tmp_path / "facts.sqlite")
    encoder = Encoder(engine, mem.prompts, mem.kv, store)
    try:
        assert _burst(engine, [store], [encoder])[1] == 0
    finally:
        encoder.stop()
        store.close()


class _EngineAway:
    """The session's real engine behind a fault: every encode fails until `until` (monotonic),
    as while a replica is away or the KV folder is full."""

    def __init__(self, engine, until: float) -> None:
        self.engine, self.until, self.calls = engine, until, 0

    def encode(self, requests) -> None:
        import time

        from kvmem.errors import EngineError

        self.calls += 1
        if time.monotonic() < self.until:
            raise EngineError("injected: the engine is away")
        self.engine.encode(requests)


def test_a_fault_of_seconds_does_not_spend_every_attempt_at_once(mem, tmp_path):
    """The background loop tried a failed batch again at once, so a fault of a few seconds spent
    a fact's three attempts within it and left the fact failed after (issue 53's disk-full row).
    Now it waits after a batch that failed whole (1 s, then 2 s here): the third try is past it."""
    import time

    store = FactStore(tmp_path / "facts.sqlite")
    ids = [r.id for r, _ in store.add_many([{"scope": Scope("away"), "text": f"Away fact {i}."} for i in range(3)])]
    engine = _EngineAway(mem.engine, until=time.monotonic() + 2.0)
    encoder = Encoder(engine, mem.prompts, mem.kv, store, max_attempts=3, backoff_s=(1.0, 4.0))
    try:
        encoder.start()
        deadline = time.monotonic() + 60
        while {store.get(f).kv_status for f in ids} != {"encoded"}:
            assert time.monotonic() < deadline, [(store.get(f).kv_status, store.get(f).kv_attempts) for f in ids]
            time.sleep(0.1)
        assert engine.calls >= 2  # it did fail first, and came back
    finally:
        encoder.stop()
        store.close()
