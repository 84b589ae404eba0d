"""Pending facts -> KV blobs: batched through the engine, retried in the background.

A fact is stored and searchable before its KV exists; until then (or if encoding fails) it is
served by text prefill. `Encoder.encode` runs a batch now; the background thread drains the
store's pending facts, retrying failures up to `max_attempts` times.

Each fact is encoded under its lease (facts/leases.py), held from before the engine is sent it
until its outcome is recorded: gateways sharing PostgreSQL, and a process's sync writes and its
background thread, never encode one fact at once, and whoever comes second finds it done.
"""

from __future__ import annotations

import logging
import threading
import time

from tqdm import tqdm

from kvmem.engine.protocol import EngineRequest
from kvmem.connector.plan import ENCODE, Plan
from kvmem.errors import BlobError, UnknownFactError
from kvmem.facts.leases import open_leases
from kvmem.results import EncodeReport

log = logging.getLogger(__name__)

LEASE_POLL_S = 0.1  # how often a sync encode looks whether another encoder gave a fact's lease back
# After a background batch of which nothing encoded (a full disk, a replica or store away: rarely
# the facts themselves), the loop waits before the next, 5 s doubling to 60 s, so a fault of
# seconds does not spend every fact's max_attempts at once and leave them failed after it.
BACKOFF_S = (5.0, 60.0)


def salt(purpose: str, user_id: str) -> str:
    """Per user and purpose: KV-mode blocks (approximate) never serve text mode, encoding or others."""
    import hashlib

    return hashlib.sha256(f"kvmem\0{purpose}\0{user_id}".encode()).hexdigest()[:32]


class Encoder:
    def __init__(self, engine, prompts, kv_store, fact_store, batch: int = 32, max_attempts: int = 3,
                 on_encoded=None, verify_blobs: bool = True, leases=None, lease_wait_s: float = 300.0,
                 backoff_s: tuple[float, float] = BACKOFF_S) -> None:
        """`leases`: default, open_leases on the fact store and the KV store's model fingerprint.
        `lease_wait_s`: how long a sync encode waits for a fact another encoder holds.
        `backoff_s`: the background loop's first and longest wait after a batch that failed whole."""
        self.engine = engine
        self.verify_blobs = verify_blobs  # read each new blob whole (checksum), or only its header / stamp
        self.on_encoded = on_encoded  # called with each record whose blob was written and recorded
        self.prompts = prompts
        self.kv = kv_store
        self.facts = fact_store
        self.batch = batch
        self.max_attempts = max_attempts
        self.leases = leases or open_leases(fact_store, kv_store.fingerprint if kv_store is not None else "")
        self.lease_wait_s = lease_wait_s
        self.backoff_s = backoff_s
        self.sent = 0  # facts sent to the engine to encode, since this Encoder was made (/metrics)
        self._sent_lock = threading.Lock()
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
        head = self.prompts.head_id
        if self.blob_ok(head) or not self._lease_one(head):
            return  # stored, or another encoder kept it past lease_wait_s: the facts' encodes will say
        try:
            if not self.blob_ok(head):  # the lease may have been given back by its encoder
                prompt = self.prompts.head_encoding()
                self.engine.encode([EngineRequest(prompt.token_ids, salt("encode", ""), 1,
                                                  Plan(ENCODE, prompt.segments))])
        finally:
            self.leases.release([head])

    def _lease_one(self, key: str) -> bool:
        deadline = time.monotonic() + self.lease_wait_s
        while not self.leases.acquire([key]):
            if time.monotonic() > deadline:
                return False
            time.sleep(LEASE_POLL_S)
        return True

    def encode(self, records, *, progress: bool | None = None) -> EncodeReport:
        """Encode now; each fact ends 'encoded' or 'failed' (then retried in the background). A
        fact another encoder holds is waited for (up to lease_wait_s), not encoded twice."""
        start = time.perf_counter()
        records = list({r.id: r for r in records}.values())
        show = len(records) >= 2 * self.batch if progress is None else progress
        done: dict[str, bool] = {}
        deadline = time.monotonic() + self.lease_wait_s
        with tqdm(total=len(records), desc="encoding facts", unit="fact", disable=not show) as bar:
            waiting = records
            while waiting:
                held = self.leases.acquire(r.id for r in waiting)
                mine = [r for r in waiting if r.id in held]
                for i in range(0, len(mine), self.batch):
                    chunk = mine[i : i + self.batch]
                    done.update(self._encode_leased(chunk))
                    bar.update(len(chunk))
                waiting = [r for r in waiting if r.id not in held]
                if waiting and time.monotonic() > deadline:
                    break  # left 'pending': the background retries them
                if waiting:
                    time.sleep(LEASE_POLL_S)
        failed = tuple(r.id for r in records if not done.get(r.id, False))
        return EncodeReport(len(records) - len(failed), failed, time.perf_counter() - start)

    def _encode_leased(self, records) -> dict[str, bool]:
        """Encode what is still to do of facts whose leases this encoder holds, record each
        outcome, then give the leases back -> fact id: whether its blob is usable."""
        try:
            todo = [r for r in records if self._undone(r)]
            if todo:
                self.ensure_head()
                self._run(todo)
            return {r.id: self._settle(r) for r in records}
        finally:
            self.leases.release(r.id for r in records)

    def _undone(self, record) -> bool:
        """False when another encoder stamped this text's blob before giving its lease back (or
        the fact is gone: _settle drops its KV)."""
        try:
            current = self.facts.get(record.id)
        except UnknownFactError:
            return False
        same = current.text == record.text and current.context == record.context
        return not (same and current.kv_status == "encoded")

    def _run(self, records) -> None:
        requests = []
        for r in records:
            prompt = self.prompts.encoding(r.id, self.prompts.fact_tokens(r.text), self.prompts.context_tokens(r.context))
            requests.append(EngineRequest(prompt.token_ids, salt("encode", r.scope.user_id), 1,
                                          Plan(ENCODE, prompt.segments), route=r.scope.user_id))
        with self._sent_lock:
            self.sent += len(requests)
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
        self.leases.close()

    def _claim(self, limit: int):
        """Up to `limit` due facts, leased to this encoder (those deleted meanwhile given back)."""
        records, gone = [], []
        for fact_id in self.leases.claim(limit, self.max_attempts):
            try:
                records.append(self.facts.get(fact_id))
            except UnknownFactError:
                gone.append(fact_id)
        self.leases.release(gone)
        return records

    def _loop(self) -> None:
        failures = 0  # batches in a row of which nothing encoded
        while not self._stop.is_set():
            if failures:  # a fault is likely still there: new writes do not cut this wait short
                wait = min(self.backoff_s[0] * 2 ** (failures - 1), self.backoff_s[1])
                log.warning("background encoding: a batch failed whole; next try in %.0f s", wait)
                self._stop.wait(wait)
            else:
                self._wake.wait(timeout=5.0)
            self._wake.clear()
            failures = self._drain(failures)
            if not self._wake.is_set():
                self._idle.set()

    def _drain(self, failures: int) -> int:
        """Encode due facts batch by batch until none is left or a batch fails whole; -> the
        failure streak (0 once anything encoded)."""
        while not self._stop.is_set():
            try:
                due = self._claim(self.batch)
                if not due:
                    return 0
                done = self._encode_leased(due)
            except Exception:  # noqa: BLE001 - keep the thread alive; facts stay pending
                log.exception("background encoding failed")
                return failures + 1
            if not any(done.values()):
                return failures + 1
            failures = 0
        return failures
