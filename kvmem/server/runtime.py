"""The KVMem behind the server, and the bound on chat requests in flight.

The engine loads in a thread, so the port is open at once and /health answers 503 until it is
ready. Every call into KVMem (blocking) runs in the thread pool through `call`, which counts it,
so shutdown can let in-flight calls finish before the engine closes.
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


class Runtime:
    def __init__(self, factory: Callable[[], object], max_inflight: int,
                 on_failure: Callable[[], None] | None = None) -> None:
        self._factory = factory
        self._on_failure = on_failure
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closing = False
        self._active = 0
        self.mem = None
        self.error: str | None = None
        self.loaded = threading.Event()  # set once loading ended, ready or failed
        self.gate = Gate(max_inflight)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._load, name="kvmem-loader", daemon=True)
        self._thread.start()

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
        """The KVMem, or 503 while it loads (or if it failed to)."""
        if self.mem is not None:
            return self.mem
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
