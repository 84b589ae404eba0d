"""Pending facts -> KV blobs: batched through the engine, retried in the background.

A fact is stored and searchable before its KV exists; until then (or if encoding fails) it is
served by text prefill. `Encoder.encode` runs a batch now; the background thread drains the
store's pending facts, retrying failures up to `max_attempts` times.
"""

from __future__ import annotations

import logging
import threading
import time

from tqdm import tqdm

from kvmem.engine.protocol import EngineRequest
from kvmem.connector.plan import ENCODE, Plan
from kvmem.errors import BlobError, UnknownFactError
from kvmem.results import EncodeReport

log = logging.getLogger(__name__)


def salt(purpose: str, user_id: str) -> str:
    """Per user and purpose: KV-mode blocks (approximate) never serve text mode, encoding or others."""
    import hashlib

    return hashlib.sha256(f"kvmem\0{purpose}\0{user_id}".encode()).hexdigest()[:32]


class Encoder:
    def __init__(self, engine, prompts, kv_store, fact_store, batch: int = 32, max_attempts: int = 3,
                 on_encoded=None, verify_blobs: bool = True) -> None:
        self.engine = engine
        self.verify_blobs = verify_blobs  # read each new blob whole (checksum), or only its header / stamp
        self.on_encoded = on_encoded  # called with each record whose blob was written and recorded
        self.prompts = prompts
        self.kv = kv_store
        self.facts = fact_store
        self.batch = batch
        self.max_attempts = max_attempts
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._idle = threading.Event()
        self._thread: threading.Thread | None = None

    def blob_ok(self, fact_id: str) -> bool:
        try:
            if not self.verify_blobs:
                return self.kv.intact(fact_id)
            self.kv.token_ids(fact_id)  # verifies without keeping tensors in this process
            return True
        except BlobError:
            return False

    def ensure_head(self) -> None:
        if not self.blob_ok(self.prompts.head_id):
            prompt = self.prompts.head_encoding()
            self.engine.encode([EngineRequest(prompt.token_ids, salt("encode", ""), 1, Plan(ENCODE, prompt.segments))])

    def encode(self, records, *, progress: bool | None = None) -> EncodeReport:
        """Encode now; each fact ends 'encoded' or 'failed' (then retried in the background)."""
        start = time.perf_counter()
        self.ensure_head()
        records = list(records)
        show = len(records) >= 2 * self.batch if progress is None else progress
        with tqdm(total=len(records), desc="encoding facts", unit="fact", disable=not show) as bar:
            for i in range(0, len(records), self.batch):
                chunk = records[i : i + self.batch]
                self._run(chunk)
                bar.update(len(chunk))
        failed = tuple(r.id for r in records if not self._settle(r))
        return EncodeReport(len(records) - len(failed), failed, time.perf_counter() - start)

    def _run(self, records) -> None:
        requests = []
        for r in records:
            prompt = self.prompts.encoding(r.id, self.prompts.fact_tokens(r.text), self.prompts.context_tokens(r.context))
            requests.append(EngineRequest(prompt.token_ids, salt("encode", r.scope.user_id), 1,
                                          Plan(ENCODE, prompt.segments), route=r.scope.user_id))
        try:
            self.engine.encode(requests)
        except Exception:  # noqa: BLE001 - the facts stay pending/failed and are retried
            log.exception("encoding batch of %d facts failed", len(requests))

    def _settle(self, encoded) -> bool:
        """Record the outcome; a fact deleted or changed meanwhile must not keep this blob."""
        try:
            current = self.facts.get(encoded.id)
        except UnknownFactError:
            self.kv.delete(encoded.id)  # forgotten while encoding: its KV must not outlive it
            return True
        if current.text != encoded.text or current.context != encoded.context:
            return True  # updated meanwhile: still pending, the new text gets encoded next
        ok = self.blob_ok(encoded.id)
        recorded = self.facts.set_kv_status(encoded.id, "encoded" if ok else "failed", if_text=encoded.text)
        if ok and recorded and self.on_encoded is not None:
            self.on_encoded(encoded)
        return ok

    # -- background ---------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="kvmem-encoder", daemon=True)
            self._thread.start()
        self.kick()

    def kick(self) -> None:
        self._idle.clear()
        self._wake.set()

    def wait_idle(self, timeout: float = 300.0) -> bool:
        self.kick()
        return self._idle.wait(timeout)

    def queue_depth(self) -> int:
        return self.facts.count_pending(max_attempts=self.max_attempts)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=60)

    def _due(self, limit: int):
        return self.facts.pending(limit=limit, max_attempts=self.max_attempts)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(timeout=5.0)
            self._wake.clear()
            while not self._stop.is_set():
                due = self._due(self.batch)
                if not due:
                    break
                try:
                    self.encode(due, progress=False)
                except Exception:  # noqa: BLE001 - keep the thread alive; facts stay pending
                    log.exception("background encoding failed")
                    break
            if not self._wake.is_set():
                self._idle.set()
