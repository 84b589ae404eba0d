"""Reads on a replica's connection that stop waiting once the probes call the replica silent
(kvmem/engine/watched.py), and the probes' verdict itself (health.Health.silent). The servers
are real sockets on loopback: one that accepts and never answers, one that answers late."""

from __future__ import annotations

import socket
import threading
import time

import httpx

from kvmem.bench.servers import free_port
from kvmem.engine import health, watched
from kvmem.engine.health import Health
from tests.engine.test_health import FakeReplica, serves


class Server:
    """Accepts connections; answers each request after `delay_s` (None: never)."""

    def __init__(self, delay_s: float | None) -> None:
        self.delay_s = delay_s
        self.held: list[socket.socket] = []  # never answered, kept open
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        conn.recv(65536)
        if self.delay_s is None:
            self.held.append(conn)
            return
        time.sleep(self.delay_s)
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        conn.close()

    def close(self) -> None:
        self.sock.close()


def _get(client: httpx.Client, url: str, out: dict) -> None:
    started = time.monotonic()
    try:
        out["response"] = client.get(url)
    except httpx.HTTPError as e:
        out["error"] = e
    out["took_s"] = time.monotonic() - started


def test_a_read_waiting_on_a_silent_server_ends_once_it_is_called_silent():
    server, silent = Server(None), threading.Event()
    client = httpx.Client(timeout=60, transport=watched.transport(lambda host, port: silent.is_set()))
    out: dict = {}
    try:
        waiting = threading.Thread(target=_get, args=(client, server.url, out))
        waiting.start()
        time.sleep(1.0)
        assert waiting.is_alive()  # the server is silent, but nobody said so yet: it waits
        silent.set()
        waiting.join(10)
        assert isinstance(out.get("error"), httpx.ReadError), out
        assert out["took_s"] < 1.0 + 2 * watched.WATCH_S + 1.0  # not the 60 s read timeout
    finally:
        client.close()
        server.close()


def test_a_late_answer_is_waited_for_and_the_read_timeout_still_holds():
    late, never = Server(1.5), Server(None)
    client = httpx.Client(timeout=httpx.Timeout(2.0), transport=watched.transport(lambda host, port: False))
    try:
        out: dict = {}
        _get(client, late.url, out)
        assert out["response"].text == "ok" and out["took_s"] >= 1.5
        out = {}
        _get(client, never.url, out)
        assert isinstance(out.get("error"), httpx.ReadTimeout) and 2.0 <= out["took_s"] < 2.0 + 2 * watched.WATCH_S + 1
    finally:
        client.close()
        late.close()
        never.close()


def test_a_replica_is_silent_after_unanswered_probes_only():
    """An error status (503) or foreign weights are answers: down, but not silent. Refused
    connections and probes with no answer in time count, SILENT_AFTER in a row."""
    mute, sick = Server(None), FakeReplica(None)
    dead = f"http://127.0.0.1:{free_port()}"
    h = Health([mute.url, sick.url, dead], serves, probe_s=None)
    try:
        with httpx.Client(timeout=0.5) as http:
            for i in range(health.SILENT_AFTER):
                assert not any(h.silent(u) for u in (mute.url, sick.url, dead))
                h.probe(http)
        assert h.silent(mute.url) and h.silent(dead) and not h.silent(sick.url)
        assert all(h.is_down(u) for u in (mute.url, sick.url, dead))
        sick.models = ["kvmem-ours"]
        with httpx.Client(timeout=0.5) as http:
            h.probe(http)
        assert not h.is_down(sick.url) and not h.silent(sick.url)
    finally:
        mute.close()
        sick.close()
