"""`kvmem replica` with a membership database: vLLM's server as a child, registered while it serves.

Without a database the replica command execs vLLM's server (cli/serve.py). With one, this
process stays as vLLM's parent: it starts the server, waits until it lists its models, registers
it (membership.py) and renews its lease until the server exits. On SIGTERM or SIGINT it drains
first (gateways stop sending new requests within their refresh), waits `drain_s` for what is in
flight, then stops the server and leaves. If this process is SIGKILLed the server is killed with
it (Linux's parent-death signal) and the lease runs out, so gateways stop routing to it within
LEASE_S.
"""

from __future__ import annotations

import ctypes
import logging
import signal
import subprocess
import threading
import time

import httpx

from kvmem.engine.membership import LEASE_S, Registry

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
DRAIN_S = 5.0  # after draining, how long in-flight requests get before the server is stopped
READY_TIMEOUT_S = 1800.0  # a cold start that compiles may take long; a dead child ends it sooner


def _die_with_parent() -> None:
    """In the child, before exec: be SIGKILLed when the parent dies (Linux prctl)."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class Lease:
    """Register `url` and renew its lease on a daemon thread until `stop()`."""

    def __init__(self, registry: Registry, url: str, fingerprint: str, capacity: int = 1,
                 lease_s: float = LEASE_S) -> None:
        self.registry, self.url, self.fingerprint, self.capacity, self.lease_s = \
            registry, url, fingerprint, capacity, lease_s
        self._stop = threading.Event()
        self._draining = False
        registry.register(url, fingerprint, capacity, lease_s)
        self._thread = threading.Thread(target=self._renew, name="kvmem-replica-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            try:
                if not self.registry.renew(self.url, self.lease_s) and not self._draining:
                    log.warning("membership row for %s was gone; registering again", self.url)
                    self.registry.register(self.url, self.fingerprint, self.capacity, self.lease_s)
            except Exception as e:  # noqa: BLE001 - PostgreSQL away: keep trying; the lease may lapse
                log.warning("could not renew the replica lease: %s", e)

    def drain(self) -> None:
        self._draining = True
        self.registry.drain(self.url)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            self.registry.leave(self.url)
        except Exception as e:  # noqa: BLE001 - the lease runs out by itself
            log.warning("could not leave the membership table: %s", e)


def supervise(cmd: list[str], env: dict[str, str], registry: Registry, url: str, fingerprint: str, *,
              local_url: str | None = None, capacity: int = 1, lease_s: float = LEASE_S,
              drain_s: float = DRAIN_S) -> int:
    """Run the replica's server `cmd` as a child, registered under `url` (what gateways reach)
    while it serves; local_url: where this host asks whether it is up (default `url`). -> its exit code."""
    child = subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent)
    stopping = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stopping.set()) for s in (signal.SIGTERM, signal.SIGINT)}
    lease = None
    try:
        if not _ready(child, local_url or url, stopping):
            return _finish(child)
        lease = Lease(registry, url, fingerprint, capacity, lease_s)
        log.info("replica %s registered (lease %.0f s)", url, lease_s)
        while child.poll() is None and not stopping.wait(0.5):
            pass
        if child.poll() is None:  # asked to stop: drain, let in-flight requests end, then stop the server
            lease.drain()
            log.info("replica %s draining for %.0f s", url, drain_s)
            time.sleep(drain_s)
        return _finish(child)
    finally:
        if lease is not None:
            lease.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)


def _ready(child: subprocess.Popen, url: str, stopping: threading.Event) -> bool:
    """Wait until the server lists its models (registered only once it can answer)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while child.poll() is None and not stopping.is_set() and time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        stopping.wait(0.5)
    return False


def _finish(child: subprocess.Popen) -> int:
    if child.poll() is None:
        child.send_signal(signal.SIGTERM)
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
    return child.wait()
