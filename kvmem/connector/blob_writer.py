"""Finishing encodes off the engine step: a worker-process thread that writes blobs.

The worker side enqueues the copy of an encode's K/V out of the paged cache and hands the host
tensors here with the event that marks the copy done. This thread waits for that event, cuts
the batch into one blob per fact, codes it (kv/codec.py), checksums it and writes it atomically
(with fsync), so none of that runs inside an engine step. Callers learn a blob is there by finding it in the KV store
(`KVStore.wait_for`), since they live in another process.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass

import torch

from kvmem.connector.plan import SaveJob
from kvmem.connector.staging import synchronize
from kvmem.kv.blob import KVBlob
from kvmem.kv.codec import encode, role_codecs
from kvmem.kv.store import KVStore

log = logging.getLogger("kvmem.connector")


@dataclass
class SaveBatch:
    """One step's encodes: host tensors [L, N, H, D] holding the spans of `jobs` one after another."""

    jobs: list[SaveJob]
    key: torch.Tensor  # as the engine cached them: rotated, in the cache dtype
    value: torch.Tensor
    copied: "torch.cuda.Event | None"  # the device-to-host copy is done once this has passed


class BlobWriter:
    def __init__(self, store: KVStore, codec: str = "none") -> None:
        self.store = store
        self.codec = codec
        self._roles = role_codecs(codec)  # (keys' codec, values')
        self._queue: queue.Queue[SaveBatch | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="kvmem-blob-writer", daemon=True)
        self._thread.start()

    def submit(self, batch: SaveBatch) -> None:
        self._queue.put(batch)

    def flush(self) -> None:
        """Block until every batch submitted so far is written (or has failed and been logged)."""
        self._queue.join()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=60)

    def _run(self) -> None:
        while True:
            batch = self._queue.get()
            try:
                if batch is None:
                    return
                self._write(batch)
            except Exception:  # noqa: BLE001 - a lost blob is re-encoded later; the thread must live
                log.exception("could not write KV blobs of %d requests", len(batch.jobs))
            finally:
                self._queue.task_done()

    def _write(self, batch: SaveBatch) -> None:
        synchronize(batch.copied)
        start = 0
        for job in batch.jobs:
            for span, token_ids in zip(job.spans, job.token_ids):
                end = start + span.length
                blob = KVBlob(span.fact_id, self.store.fingerprint, token_ids,
                              encode(batch.key[:, start:end], self._roles[0]),
                              encode(batch.value[:, start:end], self._roles[1]), key_position=span.start)
                try:
                    self.store.put(blob)
                except OSError as e:
                    log.error("could not write the KV blob of %s: %s", span.fact_id, e)
                start = end
