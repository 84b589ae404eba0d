"""Concurrency, the queue bound, and a SIGKILL during an import.

The crash test restarts the server with queue bound 4 (KVMEM_SERVER_MAX_INFLIGHT, read at
start), which the 429 test then uses: two engine starts for the whole directory.
"""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.server.conftest import DEFAULT_BOUND, assert_error
from tests.server.serverproc import KEYS
from tests.server.test_memory import wait_encoded


def _chat(url: str, i: int, max_tokens: int = 24, prompt: str = "Tell me about the number {}.") -> httpx.Response:
    body = {"model": "kvmem", "user": "load-user", "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": prompt.format(i)}]}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=300,
                      headers={"Authorization": f"Bearer {KEYS['alpha']}"})


def _burst(url: str, n: int) -> list[httpx.Response]:
    start = threading.Barrier(n)

    def one(i):
        start.wait()
        return _chat(url, i)

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def test_16_concurrent_chats_all_answer(servers):
    server = servers.get(DEFAULT_BOUND)
    with server.client() as c:
        c.post("/v1/memories", json={"user_id": "load-user", "facts": ["I like the number 7."], "encode": "sync"})
    responses = _burst(server.url, 16)
    assert [r.status_code for r in responses] == [200] * 16, [r.text for r in responses if r.status_code != 200]
    assert all(r.json()["choices"][0]["message"]["content"] for r in responses)


def _batch(n: int) -> list[str]:
    return [f"Imported fact number {n * 10 + i}: the code word is w{n}x{i}." for i in range(10)]


def _post_quietly(client, facts: list[str]) -> None:
    try:
        client.post("/v1/memories", json={"user_id": "importer", "facts": facts})
    except httpx.TransportError:
        pass  # killed mid-request: not acknowledged


@pytest.mark.last
def test_sigkill_during_import_then_restart(servers):
    """Five acknowledged batches, a sixth in flight at the SIGKILL: after the restart every
    acknowledged fact is there and encoded, and the sixth is all there or not at all. A chat's
    write-back (memory.store) acknowledged just before the kill survives it too."""
    server = servers.get()
    acked: list[str] = []
    with server.client() as c:
        chat = c.post("/v1/chat/completions", json={
            "model": "kvmem", "max_tokens": 4, "messages": [{"role": "user", "content": "I collect blue teapots."}],
            "memory": {"user_id": "storer", "store": "both"}})
        assert chat.status_code == 200, chat.text
        stored = chat.json()["memory"]["stored"]
        assert len(stored) in (1, 2)  # the turn, and the reply unless it was empty
        for n in range(5):
            r = c.post("/v1/memories", json={"user_id": "importer", "facts": _batch(n)})
            assert r.status_code == 200, r.text
            acked.extend(m["id"] for m in r.json()["results"])
        in_flight = threading.Thread(target=_post_quietly, args=(c, _batch(5)))
        in_flight.start()
        servers.crash()  # SIGKILL: server and engine processes, mid-import
        in_flight.join(60)
    assert len(set(acked)) == 50
    restarted = servers.get(bound=4)  # same --data-dir
    with restarted.client() as c:
        for fact_id in acked:
            assert c.get(f"/v1/memories/{fact_id}").status_code == 200
        facts = wait_encoded(c, "importer", timeout=300)
        written_back = wait_encoded(c, "storer", timeout=300)
    assert len(facts) in (50, 60)  # a batch is one transaction
    assert {f["kv_status"] for f in facts} == {"encoded"}
    assert {f["id"] for f in written_back} == set(stored) and {f["kv_status"] for f in written_back} == {"encoded"}


@pytest.mark.last
def test_429_above_the_queue_bound(servers):
    server = servers.get(bound=4)
    started = time.monotonic()
    responses = _burst(server.url, 16)
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429} and codes.count(429) >= 1 and codes.count(200) >= 1, codes
    for r in responses:
        if r.status_code == 429:
            assert assert_error(r, 429)["code"] == "rate_limit_exceeded" and r.headers["retry-after"]
    assert time.monotonic() - started < 240  # answered, not hung
    assert "kvmem_rejected_requests_total" in httpx.get(server.url + "/metrics").text


def _wait_inflight(health: httpx.Client, n: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while health.get("/health").json()["inflight_chats"] < n:
        assert time.monotonic() < deadline, f"fewer than {n} chats in flight after {timeout} s"
        time.sleep(0.01)


@pytest.mark.last
def test_sigterm_lets_inflight_chats_finish(servers):
    server = servers.get()
    # Chats of up to 256 tokens last seconds, so both are surely in flight when the SIGTERM lands
    # (short ones finished before the first /health poll on a busy CI machine), and the poller's
    # client exists before they start.
    with httpx.Client(base_url=server.url, timeout=30) as health, ThreadPoolExecutor(2) as pool:
        health.get("/health")
        futures = [pool.submit(_chat, server.url, i, 256, "Write a long story about the number {}.") for i in range(2)]
        _wait_inflight(health, 2)
        server.proc.terminate()
        responses = [f.result() for f in futures]
    assert [r.status_code for r in responses] == [200, 200]
    assert all(r.json()["usage"]["completion_tokens"] > 0 for r in responses)
    assert server.proc.wait(120) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once it is done
    assert "engine closed" in server.tail() and "Application shutdown complete" in server.tail()
