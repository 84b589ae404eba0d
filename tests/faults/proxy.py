"""A TCP proxy for fault tests: between a kvmem process and a server it depends on (PostgreSQL,
Redis, a vLLM replica), it forwards bytes until told to fail in one of the ways networks fail.

    with TcpProxy("127.0.0.1", pg_port) as proxy:   # clients connect to proxy.port (proxy.url_for(url))
        proxy.set("refuse")    # connecting is refused (nothing listens on the port: a stopped server)
        proxy.drop()           # the open connections are cut with RST, as a crash or a firewall does
        proxy.set("hang")      # accepted, and nothing is ever answered or passed on (a stalled server)
        proxy.set("delay", 2.0)  # each chunk, both ways, held back 2 s (a slow server or link)
        proxy.set("forward")   # healed

One selector loop in a daemon thread of the test process. `connections` counts accepted
connections, so a test can tell that a client came back.
"""

from __future__ import annotations

import selectors
import socket
import struct
import threading
import time
from collections import deque

MODES = ("forward", "refuse", "hang", "delay")
_CHUNK = 64 << 10
_TICK_S = 0.02  # the loop's longest sleep: how late a mode change or a delayed chunk may be


class TcpProxy:
    def __init__(self, upstream_host: str, upstream_port: int, host: str = "127.0.0.1") -> None:
        self.upstream = (upstream_host, upstream_port)
        self.mode, self.delay_s = "forward", 0.0
        self.connections = 0
        self._selector = selectors.DefaultSelector()
        self._listener: socket.socket | None = None
        self.host, self.port = host, 0
        self._listen()
        self._legs: list[_Leg] = []  # both directions of every open connection
        self._held: list[socket.socket] = []  # accepted in "hang" mode: never read, never answered
        self._commands: deque = deque()  # run by the loop's thread, which alone touches sockets
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"tcp-proxy-{self.port}", daemon=True)
        self._thread.start()

    def url_for(self, url: str) -> str:
        """`url` (scheme://[user@]host:port/...) with its host and port replaced by the proxy's."""
        head, _, rest = url.partition("://")
        netloc, slash, path = rest.partition("/")
        user, at, _ = netloc.rpartition("@")
        return f"{head}://{user}{at}{self.host}:{self.port}{slash}{path}"

    def set(self, mode: str, delay_s: float = 0.0) -> None:
        """Switch mode; returns once the loop has applied it."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self._run(lambda: self._switch(mode, delay_s))

    def drop(self) -> None:
        """Cut every open connection (RST to both ends), held ones included."""
        self._run(self._cut_all)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def __enter__(self) -> "TcpProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _run(self, command) -> None:
        done = threading.Event()
        self._commands.append((command, done))
        if not done.wait(10):
            raise TimeoutError("the proxy's loop did not answer")

    # -- the loop's thread -------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                while self._commands:
                    command, done = self._commands.popleft()
                    command()
                    done.set()
                for key, _ in self._selector.select(timeout=_TICK_S):
                    if key.fileobj is self._listener:
                        self._accept()
                    elif self.mode != "hang":  # in "hang", bytes stay in the kernel's buffers
                        key.data.read()
                now, delay = time.monotonic(), self.delay_s if self.mode == "delay" else 0.0
                for leg in list(self._legs):
                    leg.flush(now, delay)
        finally:
            self._cut_all()
            if self._listener is not None:
                self._selector.unregister(self._listener)
                self._listener.close()

    def _listen(self) -> None:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))  # port 0 the first time; the same port after a "refuse"
        sock.listen(128)
        sock.setblocking(False)
        self.port = sock.getsockname()[1]
        self._listener = sock
        self._selector.register(sock, selectors.EVENT_READ, None)

    def _switch(self, mode: str, delay_s: float) -> None:
        if mode == "refuse" and self._listener is not None:
            self._selector.unregister(self._listener)
            self._listener.close()  # nothing listens: a connect is refused by the kernel (RST to the SYN)
            self._listener = None
        elif mode != "refuse" and self._listener is None:
            self._listen()
        if mode != "hang":
            for sock in self._held:
                _reset(sock)
            self._held.clear()
        self.mode, self.delay_s = mode, delay_s

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except BlockingIOError:
            return
        self.connections += 1
        if self.mode == "hang":
            self._held.append(client)
            return
        try:
            upstream = socket.create_connection(self.upstream, timeout=5)
        except OSError:
            _reset(client)  # what the client would have seen from the server itself
            return
        for sock in (client, upstream):
            sock.setblocking(False)
        out, back = _Leg(client, upstream, self), _Leg(upstream, client, self)
        out.peer, back.peer = back, out
        self._legs += [out, back]
        self._selector.register(client, selectors.EVENT_READ, out)
        self._selector.register(upstream, selectors.EVENT_READ, back)

    def _close(self, leg: "_Leg", rst: bool = False) -> None:
        """Both directions of the leg's connection, closed (with RST to both ends: `rst`)."""
        for one in (leg, leg.peer):
            if one in self._legs:
                self._legs.remove(one)
                if not one.eof:
                    self._selector.unregister(one.src)
                _reset(one.src) if rst else one.src.close()

    def _cut_all(self) -> None:
        for leg in list(self._legs):
            self._close(leg, rst=True)
        for sock in self._held:
            _reset(sock)
        self._held.clear()


class _Leg:
    """One direction of a proxied connection: what `src` sent, on its way to `dst`."""

    def __init__(self, src: socket.socket, dst: socket.socket, proxy: TcpProxy) -> None:
        self.src, self.dst, self.proxy = src, dst, proxy
        self.peer: _Leg | None = None
        self.queue: deque[tuple[float, bytes]] = deque()
        self.eof = False

    def read(self) -> None:
        try:
            data = self.src.recv(_CHUNK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            self.queue.append((time.monotonic(), data))
            return
        self.eof = True
        self.proxy._selector.unregister(self.src)

    def flush(self, now: float, delay_s: float) -> None:
        while self.queue and self.queue[0][0] + delay_s <= now:
            _, data = self.queue.popleft()
            try:
                self.dst.setblocking(True)
                self.dst.settimeout(5)
                self.dst.sendall(data)
                self.dst.setblocking(False)
            except OSError:
                self.proxy._close(self, rst=True)
                return
        if self.eof and not self.queue:
            try:
                self.dst.shutdown(socket.SHUT_WR)  # pass the half-close on
            except OSError:
                pass
            if self.peer.eof and not self.peer.queue:
                self.proxy._close(self)


def _reset(sock: socket.socket) -> None:
    """Close with RST (SO_LINGER 0), not FIN: the peer sees 'connection reset' at once."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()
