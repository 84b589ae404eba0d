"""Readers and writers at once: no errors, no torn results, untouched scopes never change."""

from __future__ import annotations

import threading
import time

import numpy as np

from kvmem.index import ExactIndex
from kvmem.index.rwlock import RWLock


def test_readers_and_writers_together():
    dim, rng = 32, np.random.default_rng(0)
    ix = ExactIndex(dim)
    stable = rng.normal(size=(200, dim))
    ix.add("stable", [f"s{i}" for i in range(200)], stable, [{"i": i} for i in range(200)])
    queries = rng.normal(size=(20, dim))
    baseline = [ix.search("stable", q, 5) for q in queries]
    errors: list[BaseException] = []
    stop = threading.Event()

    def writer(seed: int) -> None:
        wrng = np.random.default_rng(seed)
        while not stop.is_set():
            ids = [f"c{seed}-{j}" for j in wrng.integers(0, 100, size=8)]
            ix.add("churn", ids, wrng.normal(size=(8, dim)), [{"w": seed}] * 8)
            for id_ in ids[:5]:
                ix.remove("churn", id_)

    def reader() -> None:
        for _ in range(150):
            for q, want in zip(queries, baseline):
                assert ix.search("stable", q, 5) == want
            hits = ix.search("churn", queries[0], 10, {"w": {"in": [1, 2]}})
            assert len({h.id for h in hits}) == len(hits) <= 10
            assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)

    def guard(fn, *args):
        try:
            fn(*args)
        except BaseException as exc:  # surfaced in the main thread below
            errors.append(exc)

    writers = [threading.Thread(target=guard, args=(writer, s)) for s in (1, 2)]
    readers = [threading.Thread(target=guard, args=(reader,)) for _ in range(3)]
    for t in writers + readers:
        t.start()
    for t in readers:
        t.join()
    stop.set()
    for t in writers:
        t.join()
    assert not errors, errors[0]
    assert ix.count("stable") == 200


def _until(check, what: str) -> None:
    deadline = time.monotonic() + 30
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


def test_rwlock_readers_share_writers_exclude():
    """No sleeps: readers hold the lock until released; the writer is seen queued before that."""
    lock, log, lock_log = RWLock(), [], threading.Lock()
    both_reading = threading.Barrier(3, timeout=30)  # two readers and this thread
    release = threading.Event()

    def read():
        with lock.read():
            both_reading.wait()  # times out unless both readers hold the lock at once
            release.wait(30)
            with lock_log:
                log.append("r")

    def write():
        with lock.write():
            with lock_log:
                log.append("w-in")
            with lock_log:
                log.append("w-out")

    readers = [threading.Thread(target=read) for _ in range(2)]
    for t in readers:
        t.start()
    both_reading.wait()
    w = threading.Thread(target=write)
    w.start()
    _until(lambda: lock._writers_waiting == 1, "the writer to queue")
    assert log == []  # queued behind the readers, not inside
    release.set()
    for t in readers + [w]:
        t.join(timeout=30)
    assert log == ["r", "r", "w-in", "w-out"]  # the writer waited for both readers
