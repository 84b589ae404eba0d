"""Worker side of the connector: write injected K/V into the paged cache, read encoded K/V out.

Runs in vLLM's worker process, once per engine step. Both directions are batched per layer:
all tokens of all requests in a step take one rotation call (layers folded into heads) and one
cache-update call per layer.
"""

from __future__ import annotations

import logging
import re

import torch

from kvmem.engine.paged import PageLayout
from kvmem.engine.rope import KeyRotator
from kvmem.engine.scheduler_side import ConnectorMeta, Piece
from kvmem.errors import BlobError
from kvmem.kv.blob import KVBlob
from kvmem.kv.store import KVStore

log = logging.getLogger("kvmem.connector")


class WorkerSide:
    def __init__(self, store: KVStore, rotator: KeyRotator, block_size: int, num_blocks: int,
                 num_kv_heads: int, head_size: int, key_dtype: torch.dtype, value_dtype: torch.dtype | None,
                 layers: dict) -> None:
        self.store = store
        self.rotator = rotator
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.key_dtype = key_dtype
        self.value_dtype = value_dtype
        self._layers = layers  # layer name -> attention layer (static forward context)
        self._caches: list[tuple[str, torch.Tensor]] = []
        self._layout: PageLayout | None = None
        self.failed_block_ids: set[int] = set()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._caches = sorted(kv_caches.items(), key=lambda kv: _layer_index(kv[0]))
        shapes = {(tuple(c.shape), c.stride(), c.dtype) for _, c in self._caches}
        if len(shapes) != 1:
            # One calibrated layout serves every layer; hybrid/cross-layer layouts are not supported.
            raise NotImplementedError(f"kvmem needs identical per-layer KV caches, got {shapes}")

    # -- injection ------------------------------------------------------------------------------

    def load(self, meta: ConnectorMeta) -> None:
        pieces = [p for _, ps in meta.loads for p in ps]
        if not pieces:
            return
        try:
            key, value = self._blob_tokens(pieces)  # each [L, N, H, D]
        except BlobError as e:
            # The scheduler verified these blobs moments ago; losing one now is rare. vLLM
            # recomputes the blocks we report (kv_load_failure_policy), so nothing is lost.
            log.error("injection failed, blocks will be recomputed: %s", e)
            self.failed_block_ids.update(s // self.block_size for p in pieces for s in p.slots)
            return
        positions = torch.tensor([q for p in pieces for q in p.positions])
        slots = torch.tensor([s for p in pieces for s in p.slots])
        _, cache = self._caches[0]
        dev, dtype = cache.device, cache.dtype
        key = self.rotator.rotate(key.to(dev), positions, inplace=True).to(dtype)  # [L, N, H, D]
        value = value.to(dev, dtype)
        slots = slots.to(dev)
        for (name, cache), k, v in zip(self._caches, key, value):
            layer = self._layers[name]
            layer.impl.do_kv_cache_update(layer, k, v, cache, slots)

    def _blob_tokens(self, pieces: list[Piece]) -> tuple[torch.Tensor, torch.Tensor]:
        """-> key float32 [L, N, H, D] (a fresh buffer, safe to rotate in place), value [L, N, H, D]."""
        blobs = [(self.store.get(p.fact_id), p.src, len(p.slots)) for p in pieces]
        first = blobs[0][0]
        layers, _, heads, dim = first.key.shape
        total = sum(n for _, _, n in blobs)
        key = torch.empty(layers, total, heads, dim, dtype=torch.float32)
        value = torch.empty(layers, total, heads, dim, dtype=first.value.dtype)
        start = 0
        for blob, src, n in blobs:
            key[:, start : start + n] = blob.key[:, src : src + n]
            value[:, start : start + n] = blob.value[:, src : src + n]
            start += n
        return key, value

    # -- encoding -------------------------------------------------------------------------------

    def save(self, meta: ConnectorMeta) -> None:
        jobs = [(p, keep) for _, ps, keep in meta.saves for p in ps]
        if not jobs:
            return
        slots = torch.tensor([s for p, _ in jobs for s in p.slots])
        positions = torch.tensor([q for p, _ in jobs for q in p.positions])
        cached_k, value = self.gather(slots)  # [L, N, H, D] each
        key = self.rotator.unrotate(cached_k, positions).to(self.key_dtype)
        value = value.to(self.value_dtype or value.dtype)
        start = 0
        for piece, keep_rotated in jobs:
            n = len(piece.slots)
            extras = {"key_rotated": cached_k[:, start : start + n].clone()} if keep_rotated else {}
            blob = KVBlob(piece.fact_id, self.store.fingerprint, piece.token_ids,
                          key[:, start : start + n].clone(), value[:, start : start + n].clone(), extras)
            try:
                self.store.put(blob)
            except OSError as e:
                log.error("could not write the KV blob of %s: %s", piece.fact_id, e)
            start += n

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """slots [N] -> key, value [L, N, H, D] as cached (keys rotated)."""
        layout = self._page_layout()
        pairs = [layout.gather(cache, slots.to(cache.device)) for _, cache in self._caches]
        return (torch.stack([k for k, _ in pairs]).cpu(), torch.stack([v for _, v in pairs]).cpu())

    def _page_layout(self) -> PageLayout:
        if self._layout is None:
            name, cache = self._caches[0]
            layer = self._layers[name]

            def write(k, v, c, s):
                layer.impl.do_kv_cache_update(layer, k, v, c, s)

            self._layout = PageLayout.calibrate(cache, self.num_blocks, self.block_size,
                                                self.num_kv_heads, self.head_size, write)
        return self._layout


def _layer_index(name: str) -> int:
    found = re.findall(r"\.(\d+)\.", name)
    return int(found[0]) if found else 0
