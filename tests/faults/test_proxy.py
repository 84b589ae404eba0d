"""The fault tests' TCP proxy (tests/faults/proxy.py) against a real echo server on loopback:
each mode does to a client what the module docstring says, and healing restores forwarding."""

from __future__ import annotations

import socket
import socketserver
import threading
import time

import pytest

from tests.faults.proxy import TcpProxy


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(4096):
            self.request.sendall(data)


@pytest.fixture(scope="module")
def echo():
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address
    server.shutdown()


@pytest.fixture
def proxy(echo):
    with TcpProxy(*echo) as p:
        yield p


def _round_trip(proxy: TcpProxy, payload: bytes = b"ping", timeout: float = 2.0) -> bytes:
    with socket.create_connection((proxy.host, proxy.port), timeout=timeout) as s:
        s.sendall(payload)
        return s.recv(4096)


def test_forward_passes_bytes_both_ways(proxy):
    assert _round_trip(proxy) == b"ping"
    assert proxy.url_for("postgresql://u:pw@db:5432/x") == f"postgresql://u:pw@127.0.0.1:{proxy.port}/x"


def test_refuse_refuses_until_healed_on_the_same_port(proxy):
    proxy.set("refuse")
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((proxy.host, proxy.port), timeout=2)
    proxy.set("forward")
    assert _round_trip(proxy) == b"ping"


def test_drop_resets_open_connections(proxy):
    s = socket.create_connection((proxy.host, proxy.port), timeout=2)
    s.sendall(b"a")
    assert s.recv(16) == b"a"
    proxy.drop()
    with pytest.raises((ConnectionResetError, BrokenPipeError)):
        s.sendall(b"b")
        if not s.recv(16):  # a FIN instead of a reset would read as b""
            raise BrokenPipeError
    s.close()


def test_hang_accepts_and_never_answers(proxy):
    proxy.set("hang")
    with socket.create_connection((proxy.host, proxy.port), timeout=2) as s:
        s.sendall(b"ping")
        s.settimeout(0.5)
        with pytest.raises(TimeoutError):
            s.recv(16)
    proxy.set("forward")
    assert _round_trip(proxy) == b"ping"


def test_delay_holds_each_chunk_back(proxy):
    proxy.set("delay", 0.3)
    started = time.monotonic()
    assert _round_trip(proxy) == b"ping"
    assert time.monotonic() - started >= 0.6  # held once each way
