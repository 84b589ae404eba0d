"""A real `python -m kvmem.server` subprocess on 127.0.0.1, in its own process group."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

KEYS = {"alpha": "sk-alpha-test-key", "beta": "sk-beta-test-key"}
MAX_BODY = 256 * 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_config(path: Path) -> Path:
    tenants = "\n".join(f'{t} = "{k}"' for t, k in KEYS.items())
    # A wide graceful-shutdown window: the SIGTERM test's two 256-token chats took over the default
    # 30 s once on a loaded 2-core CI machine (they finish in ~10 s on an idle one).
    path.write_text(f"[server]\nmax_body_bytes = {MAX_BODY}\ngraceful_timeout_s = 120\n\n[tenants]\n{tenants}\n")
    return path


class ServerProc:
    def __init__(self, data_dir: Path, config: Path, log: Path, bound: int) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.bound = bound
        self.log = log
        self.loading: dict[str, httpx.Response] = {}  # responses seen while the engine loaded
        # No reader adapter: these tests time chats against the server's graceful-shutdown window,
        # and LoRA on vLLM's CPU backend slows every KV-mode decode step (docs/benchmarks.md);
        # serving with the adapter is tested in tests/reader/test_serving.py.
        # 1 GiB of KV cache (~46k tokens of the bundled model) is plenty for these tests, and the
        # suite's engines and servers share 24 GiB.
        env = {**os.environ, "KVMEM_SERVER_MAX_INFLIGHT": str(bound), "KVMEM_READER_ADAPTER": "off",
               "KVMEM_CPU_KV_SPACE_GIB": "1"}
        cmd = [sys.executable, "-m", "kvmem.server", "--host", "127.0.0.1", "--port", str(self.port),
               "--home", str(data_dir), "--config", str(config)]
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def client(self, tenant: str | None = "alpha", **kw) -> httpx.Client:
        headers = {"Authorization": f"Bearer {KEYS[tenant]}"} if tenant else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=kw.pop("timeout", 180), **kw)

    def wait_ready(self, timeout: float = 400.0) -> "ServerProc":
        deadline = time.monotonic() + timeout
        with self.client() as c:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.tail()}")
                try:
                    r = c.get("/health")
                except httpx.TransportError:
                    time.sleep(0.3)
                    continue
                if r.status_code == 200:
                    return self
                if "health" not in self.loading:
                    self.loading["health"] = r
                    self.loading["chat"] = c.post("/v1/chat/completions", json={
                        "model": "kvmem", "messages": [{"role": "user", "content": "hi"}]})
                time.sleep(0.5)
        raise TimeoutError(f"server not ready after {timeout} s:\n{self.tail()}")

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the whole process group: the server and vLLM's engine processes."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)

    def stop(self, timeout: float = 90.0) -> int | None:
        """SIGTERM (graceful), then SIGKILL of the group if it does not exit in time; the exit code."""
        if self.alive:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        code = self.proc.poll()
        self.kill()  # engine processes left behind, if any
        return code
