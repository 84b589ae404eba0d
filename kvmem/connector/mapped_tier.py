"""The worker's RAM tier of mapped blobs: fact blobs through the reader's KV map, mapped once.

Runs in vLLM's worker process, beside the store's own RAM tier, on the CPU backend (where the
cache's device is the host the blobs are on). The KV map is a per-layer, per-head transform of
keys (a complex multiply per rotary pair, which commutes with RoPE) and of values (an affine
map), whatever the token's position (reader/kvmap.py). So a blob can be mapped where it was
encoded and then moved and injected as any other: a step's facts that are hot here cost it no
map work, where mapping them in the step cost a fifth of KV mode's time to first token at k=50
on the CPU backend (docs/benchmarks.md, "The KV map's TTFT cost"). On a GPU that work is small
and stays in the step (placement.py), as it does for coded blobs (a mapped copy would have to be
stored decoded).

A mapped blob is kept while the store serves the blob it was mapped from: the very object, or
the same file read again (the same verified checksum, `KVBlob.digest`) after the store's own RAM
tier let it go. Under load the store reads most facts again (16 users with 200 facts each: a
RAM-tier hit rate of 0.39), and mapping them anew took 255 of the connector's 426 ms per step
(docs/benchmarks.md, "16 users on the AMX Xeon"). A rewritten fact has a new checksum, and a blob
built in memory has none: those are mapped again.
"""

from __future__ import annotations

import threading

import torch

from kvmem.connector.placement import DeviceKVMap
from kvmem.connector.staging import HostStaging, concat_tokens
from kvmem.kv.blob import KVBlob
from kvmem.kv.lru import ByteLRU


class MappedTier:
    """Mapped copies of codec-none blobs, least recently used first out, within `limit_bytes`.
    An entry knows its source by checksum, or (a blob built in memory) holds the source itself
    and counts its bytes too."""

    def __init__(self, key_map: DeviceKVMap, limit_bytes: int) -> None:
        self._map = key_map
        self._entries: ByteLRU[tuple[str | KVBlob, KVBlob]] = ByteLRU(limit_bytes)  # fact id -> (source, mapped)
        self._lock = threading.Lock()
        # The step's new blobs side by side, as stored and in float32: kept across steps, as fresh
        # tensors of that size come from the OS page by page (placement.py's `work`, likewise).
        self._work = HostStaging(pin=False)
        self.hits = 0
        self.maps = 0

    def get(self, blobs: list[KVBlob]) -> list[KVBlob | None]:
        """Each blob through the map, or None where this tier does not map it (a coded blob).
        The ones not held yet are mapped together, in one pass per op (a step's new facts)."""
        out: list[KVBlob | None] = [None] * len(blobs)
        missing: dict[int, list[int]] = {}  # id(blob) -> where it is asked for
        with self._lock:
            for i, blob in enumerate(blobs):
                if blob.codec != "none":
                    continue
                hit = self._entries.get(blob.fact_id)
                if hit is not None and (hit[0] is blob or (blob.digest is not None and hit[0] == blob.digest)):
                    self._entries.touch(blob.fact_id)
                    self.hits += 1
                    out[i] = hit[1]
                else:
                    missing.setdefault(id(blob), []).append(i)
        if missing:
            sources = [blobs[where[0]] for where in missing.values()]
            for where, blob, mapped in zip(missing.values(), sources, self._mapped(sources)):
                held, size = (blob.digest, mapped.nbytes) if blob.digest else (blob, blob.nbytes + mapped.nbytes)
                with self._lock:
                    self._entries.put(blob.fact_id, (held, mapped), size)
                for i in where:
                    out[i] = mapped
        return out

    def _mapped(self, blobs: list[KVBlob]) -> list[KVBlob]:
        """The blobs' keys and values [L, T, H, D] through every layer's map, all blobs at once
        (concatenated along T), in float32, rounded back to their stored dtypes."""
        lengths = [b.num_tokens for b in blobs]
        shape = (blobs[0].key.shape[0], sum(lengths), *blobs[0].key.shape[2:])  # [L, sum T, H, D]
        dtypes = {b.key.dtype for b in blobs} | {b.value.dtype for b in blobs}
        stored = dtypes.pop() if len(dtypes) == 1 else torch.float32  # one staging dtype for all
        with self._lock:  # one step maps at a time: the buffers are this tier's
            k, v, k_in, v_in = self._work.take([(shape, torch.float32)] * 2 + [(shape, stored)] * 2)
            concat_tokens([b.key for b in blobs], k_in)
            concat_tokens([b.value for b in blobs], v_in)
            k.copy_(k_in)
            v.copy_(v_in)
            self._map.keys_(k)
            self._map.values_(v)
            out = self._split(blobs, lengths, k, v)
        self.maps += len(blobs)
        return out

    @staticmethod
    def _split(blobs: list[KVBlob], lengths: list[int], k: torch.Tensor, v: torch.Tensor) -> list[KVBlob]:
        """The mapped [L, sum T, H, D] back into one blob per source, each in its own tensors,
        in the source's dtypes (a tier entry must not keep a step's whole buffer alive)."""
        out, at = [], 0
        for blob, n in zip(blobs, lengths):
            key, value = (t[:, at : at + n].to(like.dtype, copy=True) for t, like in ((k, blob.key), (v, blob.value)))
            out.append(KVBlob(blob.fact_id, blob.fingerprint, blob.token_ids, key, value, blob.key_position))
            at += n
        return out
