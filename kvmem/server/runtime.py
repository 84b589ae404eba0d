"""The KVMem behind the server, and the bound on chat requests in flight.

The engine loads in a thread, so the port is open at once and /health answers 503 until it is
ready. Every call into KVMem (blocking) runs in the thread pool through `call`, which counts it,
so shutdown can let in-flight calls finish before the engine closes.

Two states answer every request with a 503 and a Retry-After, never a hang: draining (SIGTERM
received: the calls in flight finish, new ones are sent elsewhere; cli.py) and restarting (the
in-process engine died: a watchdog closes the KVMem and builds a new one, as at start).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from starlette.concurrency import run_in_threadpool

from kvmem.server.errors import ApiError

log = logging.getLogger("kvmem.server")


class Gate:
    """Chat requests being answered; above `limit` a new one is refused at once (429), never queued."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.count = 0  # touched on the event loop only

    def enter(self) -> bool:
        if self.count >= self.limit:
            return False
        self.count += 1
        return True

    def leave(self) -> None:
        self.count -= 1


WATCH_S = 0.5  # how often the watchdog asks whether the engine died
DEATH_GRACE_S = 1.0
RESTART_DRAIN_S = 30.0  # calls on a dead engine fail at once; this only bounds a stuck one


class Runtime:
    def __init__(self, factory: Callable[[], object], max_inflight: int,
                 on_failure: Callable[[], None] | None = None,
                 dead: Callable[[object], bool] | None = None) -> None:
        """dead(mem): whether its engine died for good (then it is rebuilt); None: never asked."""
        self._factory = factory
        self._on_failure = on_failure
        self._dead = dead
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closing = False
        self._active = 0
        self.mem = None
        self.error: str | None = None
        self.loaded = threading.Event()  # set once loading ended, ready or failed
        self.gate = Gate(max_inflight)
        self.draining = False  # SIGTERM received: new requests get 503 while the ones in flight finish
        self.restarting = False  # the engine died and is being rebuilt
        self.restarts = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._load, name="kvmem-loader", daemon=True)
        self._thread.start()
        if self._dead is not None:
            threading.Thread(target=self._watch, name="kvmem-engine-watchdog", daemon=True).start()

    def _watch(self) -> None:
        """Runs on its own thread for the server's life: rebuilds the KVMem when its engine died."""
        while not self._closing:
            time.sleep(WATCH_S)
            mem = self.mem
            if mem is not None and not self.draining and self._dead(mem):
                # A SIGTERM sent to the whole process group stops the engine too: the server's own
                # handler (draining) gets a moment to say so before a death is taken as one.
                time.sleep(DEATH_GRACE_S)
                if not (self.draining or self._closing):
                    self._restart(mem)

    def _restart(self, mem) -> None:
        died = time.perf_counter()
        with self._lock:
            if self._closing or self.mem is not mem:
                return
            self.mem, self.restarting = None, True
        self.restarts += 1
        log.error("the engine died; restarting it (requests get 503 until it is back)")
        deadline = time.monotonic() + RESTART_DRAIN_S
        while self._active and time.monotonic() < deadline:
            time.sleep(0.05)
        try:
            mem.close()
        except Exception:  # noqa: BLE001 - a dead engine may fail to close; the new one matters
            log.exception("closing the dead engine failed")
        self._thread = threading.current_thread()  # close() waits for this rebuild as for a first load
        self._load_mem()
        self.restarting = False
        if self.mem is not None:
            log.info("engine restarted %.1f s after it died", time.perf_counter() - died)

    def _load(self) -> None:
        try:
            self._load_mem()
        finally:
            self.loaded.set()

    def _load_mem(self) -> None:
        started = time.perf_counter()
        try:
            mem = self._factory()
        except BaseException as e:  # noqa: BLE001 - reported by /health and the log, then the server stops
            log.exception("the engine failed to start")
            self.error = f"{type(e).__name__}: {e}"
            if self._on_failure:
                self._on_failure()
            return
        with self._lock:
            if not self._closing:
                self.mem = mem
        if self.mem is not mem:  # shut down while loading
            mem.close()
            return
        log.info("engine ready in %.1f s", time.perf_counter() - started)

    def require(self):
        """The KVMem, or 503 while it loads (or if it failed to), restarts or drains."""
        if self.draining:
            raise ApiError(503, "the server is shutting down; retry on another instance, or here once it is back",
                           type="server_error", code="shutting_down", headers={"Retry-After": "5"})
        if self.mem is not None:
            return self.mem
        if self.restarting:
            raise ApiError(503, "the engine died and is restarting; retry shortly", type="server_error",
                           code="engine_restarting", headers={"Retry-After": "10"})
        if self.error:
            raise ApiError(503, f"the engine failed to start: {self.error}", type="server_error", code="engine_failed")
        raise ApiError(503, "the engine is loading; retry shortly", type="server_error", code="engine_loading",
                       headers={"Retry-After": "5"})

    async def call(self, fn: Callable, *args, **kwargs):
        """Run a blocking KVMem call in the thread pool, counted as in flight."""
        self._active += 1
        try:
            return await run_in_threadpool(fn, *args, **kwargs)
        finally:
            self._active -= 1

    def drain(self, timeout_s: float) -> bool:
        """Refuse new requests (503), then wait until none is in flight, up to timeout_s; -> whether
        none is. Called on SIGTERM, before the server stops (cli.py)."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        idle_since = None
        while time.monotonic() < deadline:
            if self._active or self.gate.count:
                idle_since = None
            elif idle_since is None:
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since >= 0.2:  # a request past require() but not yet counted
                return True
            time.sleep(0.02)
        if self._active or self.gate.count:
            log.warning("still in flight after %.0f s: %d calls, %d chats", timeout_s, self._active, self.gate.count)
        return not (self._active or self.gate.count)

    def close(self, drain_s: float = 30.0, load_wait_s: float = 180.0) -> None:
        """Let in-flight calls finish (up to drain_s), then stop the encoder and the engine.

        Facts not yet encoded stay pending in the store; the next start encodes them.
        """
        deadline = time.monotonic() + drain_s
        while self._active and time.monotonic() < deadline:
            time.sleep(0.05)
        with self._lock:
            self._closing = True
            mem, self.mem = self.mem, None
        if mem is None and self._thread is not None and self._thread.is_alive():
            log.info("shutting down while the engine loads: waiting for it, to close it cleanly")
            self._thread.join(load_wait_s)
        if mem is not None:
            if self._active:
                log.warning("closing with %d calls still running", self._active)
            mem.close()
            log.info("engine closed; facts not yet encoded stay pending and resume at the next start")
