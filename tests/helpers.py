"""Small helpers shared by the engine tests."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

# KV cache of the suite's in-process engines, not the default 2 GiB: the suite's engines and servers
# share 24 GiB, and a smaller cache also starts ~2 s sooner.
TEST_KV_CACHE_GIB = 1


def add_fact(mem, user_id: str, text: str, context: str = "", encode: str = "sync"):
    """Store one fact and return its record."""
    (fact_id,) = mem.add(facts=[text], user_id=user_id, context=context, encode=encode).ids
    return mem.get(fact_id)


def tokens(mem, record) -> tuple[int, ...]:
    return mem.prompts.fact_tokens(record.text)


def in_threads(fn, n: int) -> list:
    """fn(0..n-1) on n threads at once; results in order (an exception in any call is raised)."""
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(fn, range(n)))


def until(check, timeout: float, poll_s: float = 0.05) -> None:
    """Wait for check() to hold; the test fails after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout} s")
        time.sleep(poll_s)
