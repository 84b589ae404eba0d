"""A TCP proxy in front of a vLLM replica that can hang, or hold back the replies to completions.

    proxy = ReplicaProxy("127.0.0.1", replica_port)   # a gateway is given proxy.url as a replica
    proxy.set("hang")         # connections accepted, requests swallowed, nothing ever answered
    proxy.set("hold", 10.0)   # each reply to a POST starts 10 s late (a long prefill); GETs are prompt
    proxy.set("forward")      # healed (connections held by "hang" are reset)

tests/faults/proxy.py's TcpProxy delays every chunk both ways; a slow replica's model list
(the gateway's health probe) answers at once while its completions take long, which is what
"hold" does: the gateway must wait for such a replica, not give it up.
"""

from __future__ import annotations

import socket
import threading
import time

from tests.faults.proxy import _reset  # close with RST: the peer sees a reset at once

MODES = ("forward", "hang", "hold")


class ReplicaProxy:
    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.mode, self.hold_s = "forward", 0.0
        self._held: list[socket.socket] = []
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._closed = False
        threading.Thread(target=self._accept, name="replica-proxy", daemon=True).start()

    def set(self, mode: str, hold_s: float = 0.0) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        with self._lock:
            self.mode, self.hold_s = mode, hold_s
            held, self._held = self._held, []
        if mode != "hang":
            for sock in held:
                _reset(sock)

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        self.set("forward")

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                if self.mode == "hang":
                    self._held.append(client)
                    continue
            try:
                upstream = socket.create_connection(self.upstream, timeout=5)
                upstream.settimeout(None)
            except OSError:
                _reset(client)
                continue
            conn = {"hold": 0.0}
            threading.Thread(target=self._pump, args=(client, upstream, conn, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, conn, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, conn: dict, request: bool) -> None:
        try:
            while data := src.recv(65536):
                if self.mode == "hang":
                    with self._lock:  # swallowed; the connection is kept open, answering nothing
                        self._held += [s for s in (src, dst) if s not in self._held]
                    continue
                if request and data.startswith(b"POST ") and self.mode == "hold":
                    conn["hold"] = self.hold_s
                elif not request and conn["hold"]:
                    time.sleep(conn["hold"])
                    conn["hold"] = 0.0
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)  # a closed end is passed on as a close (FIN), as the server sent it
        except OSError:
            for sock in (src, dst):
                _reset(sock)
            return
        with self._lock:
            conn["closed"] = conn.get("closed", 0) + 1
            if conn["closed"] < 2:
                return
        for sock in (src, dst):
            sock.close()

