"""HTTP connections to replicas that stop waiting once a replica is known to have gone silent.

A blocking read cannot be interrupted from another thread, so a request sent to a replica that
accepts connections and then never answers would wait out the whole reply timeout, however soon
the health probes (health.py) find the replica silent. Here each read on a replica's connection
waits for data in slices of WATCH_S and, between slices, asks `give_up(host, port)`: once that is
true the read ends with a ReadError, which the gateway treats as a dropped connection (the request
goes to the user's next replica when nothing of it reached the caller yet). A slow answer is never
cut short: only the probes' verdict, or the read timeout itself, ends a wait.
"""

from __future__ import annotations

import select
import time
from collections.abc import Callable

import httpcore
import httpx

WATCH_S = 0.25  # how often a waiting read asks whether its replica went silent

GiveUp = Callable[[str, int], bool]  # (host, port) -> stop waiting for that replica


def transport(give_up: GiveUp) -> httpx.HTTPTransport:
    """httpx's own transport, its connections made by a backend whose reads watch `give_up`."""
    t = httpx.HTTPTransport()
    # httpx takes no network backend of its own; its connection pool (httpcore) does. Swapping
    # the pool's backend keeps every other setting httpx chose (TLS, limits, keep-alive).
    pool = t._pool  # noqa: SLF001 - see above
    pool._network_backend = _Backend(give_up, pool._network_backend)  # noqa: SLF001
    return t


class _Backend(httpcore.NetworkBackend):
    def __init__(self, give_up: GiveUp, inner: httpcore.NetworkBackend) -> None:
        self._give_up = give_up
        self._inner = inner

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options=None) -> httpcore.NetworkStream:
        stream = self._inner.connect_tcp(host, port, timeout=timeout, local_address=local_address,
                                         socket_options=socket_options)
        return _Stream(stream, lambda: self._give_up(host, port))

    def connect_unix_socket(self, path: str, timeout: float | None = None, socket_options=None):
        return self._inner.connect_unix_socket(path, timeout=timeout, socket_options=socket_options)

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


class _Stream(httpcore.NetworkStream):
    def __init__(self, inner: httpcore.NetworkStream, give_up: Callable[[], bool]) -> None:
        self._inner = inner
        self._give_up = give_up

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        self._wait_readable(timeout)
        return self._inner.read(max_bytes, timeout)

    def _wait_readable(self, timeout: float | None) -> None:
        sock = self._inner.get_extra_info("socket")
        if sock is None or (hasattr(sock, "pending") and sock.pending()):  # TLS: bytes already decrypted
            return
        poller = select.poll()  # not select(): file descriptors above 1024 are fine
        poller.register(sock, select.POLLIN | select.POLLPRI | select.POLLERR | select.POLLHUP)
        deadline = None if timeout is None else time.monotonic() + timeout
        while not poller.poll(WATCH_S * 1000):
            if self._give_up():
                raise httpcore.ReadError("the replica went silent: its health probes get no answer")
            if deadline is not None and time.monotonic() >= deadline:
                raise httpcore.ReadTimeout("timed out")

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, timeout)

    def close(self) -> None:
        self._inner.close()

    def start_tls(self, ssl_context, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore.NetworkStream:
        return _Stream(self._inner.start_tls(ssl_context, server_hostname, timeout), self._give_up)

    def get_extra_info(self, info: str):
        return self._inner.get_extra_info(info)
