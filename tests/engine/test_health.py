"""Replica health as a gateway learns it: failed requests, and a probe of each replica's model
list. The replicas here are real HTTP servers on loopback (http.server), answering as vLLM's
/v1/models does, or not at all."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from kvmem.bench.servers import free_port
from kvmem.engine import health
from kvmem.engine.health import Health


class FakeReplica:
    """An HTTP server whose /v1/models lists `models` (None: answers 503)."""

    def __init__(self, models: list[str] | None) -> None:
        self.models = models
        replica = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                if replica.models is None:
                    self.send_response(503)
                    self.end_headers()
                    return
                body = json.dumps({"data": [{"id": m} for m in replica.models]}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def replicas():
    made = [FakeReplica(["kvmem-ours"]), FakeReplica(["kvmem-ours"])]
    yield made
    for r in made:
        r.close()


def serves(ids):
    return "kvmem-ours" in ids


def test_a_probe_marks_dead_unhealthy_and_foreign_replicas_down_and_the_rest_up(replicas):
    dead = f"http://127.0.0.1:{free_port()}"
    sick, foreign = FakeReplica(None), FakeReplica(["kvmem-theirs"])
    urls = [replicas[0].url, dead, sick.url, foreign.url]
    h = Health(urls, serves, probe_s=None)
    try:
        with httpx.Client(timeout=2) as http:
            assert h.probe(http) == {replicas[0].url: True, dead: False, sick.url: False, foreign.url: False}
        assert h.order(urls) == [replicas[0].url, dead, sick.url, foreign.url]  # down ones last, order kept
        assert h.order(list(reversed(urls)))[0] == replicas[0].url
        assert all(h.is_down(u) for u in (dead, sick.url, foreign.url))
        sick.models = ["kvmem-ours"]  # recovered
        with httpx.Client(timeout=2) as http:
            h.probe(http)
        assert not h.is_down(sick.url) and h.is_down(dead)  # up at once, not after DOWN_S
    finally:
        sick.close()
        foreign.close()


def test_a_failed_request_passes_a_replica_over_for_down_s_only(replicas, monkeypatch):
    a, b = (r.url for r in replicas)
    h = Health([a, b], serves, probe_s=None)
    monkeypatch.setattr(health, "DOWN_S", 0.3)
    h.mark_down(a)
    assert h.order([a, b]) == [b, a]
    time.sleep(0.35)
    assert h.order([a, b]) == [a, b]


def test_the_probe_thread_finds_a_replica_that_died_and_one_that_came_back(replicas):
    a, b = replicas
    h = Health([a.url, b.url], serves, probe_s=0.05)
    try:
        a.models = None
        deadline = time.monotonic() + 5
        while not h.is_down(a.url):
            assert time.monotonic() < deadline, "the probe never marked the replica down"
            time.sleep(0.02)
        assert h.order([a.url, b.url]) == [b.url, a.url]
        a.models = ["kvmem-ours"]
        while h.is_down(a.url):
            assert time.monotonic() < deadline, "the probe never marked the replica up again"
            time.sleep(0.02)
    finally:
        h.close()
