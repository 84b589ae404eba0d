"""Worker side of the connector: write injected K/V into the paged cache, read encoded K/V out.

Runs in vLLM's worker process. Every tensor op runs on the paged cache's device; the host only
fills a staging buffer (loads) or receives a finished copy (saves).

Injection, per step: blob tokens are gathered into one reusable (pinned) host staging buffer;
then, on a side stream and per layer, keys and values are copied to the device, keys are upcast
and rotated to their serving positions with the engine's rotary kernel, both are written with the
attention backend's own cache-update op, and an event is recorded. `wait_layer` makes the
engine's stream wait for that layer's event only, so layer i's copy overlaps layer i-1's compute.

Encoding, per step: after the forward, on the side stream, the encoded tokens are gathered from
the paged cache, keys are un-rotated on the device, and both are copied into host memory; a
background thread (blob_writer.py) writes the blobs. The request's blocks stay allocated until
the copy is done (reported through `finished`).

On vLLM's CPU backend the same code runs synchronously (no streams, no events).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping

import torch

from kvmem.engine.blob_writer import BlobWriter, SaveBatch
from kvmem.engine.paged import PageLayout, slot_mapping
from kvmem.engine.plan import ConnectorMeta, LoadJob, SaveJob
from kvmem.engine.rope import KeyRotator, LayerRotators
from kvmem.engine.staging import HostStaging, SideStream, synchronize
from kvmem.errors import BlobError
from kvmem.kv.store import KVStore

log = logging.getLogger("kvmem.connector")


class WorkerSide:
    def __init__(self, store: KVStore, rotator: KeyRotator | Mapping[str, KeyRotator], block_size: int, num_blocks: int,
                 num_kv_heads: int, head_size: int, key_dtype: torch.dtype, value_dtype: torch.dtype | None,
                 layers: dict) -> None:
        self.store = store
        self._rotator_of = rotator  # one for every layer, or per layer name
        self.rotator: LayerRotators | None = None  # per layer in cache order, once caches are registered
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.key_dtype = key_dtype
        self.value_dtype = value_dtype
        self._layers = layers  # layer name -> attention layer (static forward context)
        self._caches: list[tuple[str, torch.Tensor]] = []
        self._layout: PageLayout | None = None
        self._stream: SideStream | None = None
        self._staging: HostStaging | None = None
        self._layer_events: dict[str, object] = {}  # this step's injection, per layer
        self._copies: dict[str, object] = {}  # req id -> event: its encode's copy out of the cache is done
        self._writer = BlobWriter(store)
        self.failed_block_ids: set[int] = set()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._caches = sorted(kv_caches.items(), key=lambda kv: _layer_index(kv[0]))
        shapes = {(tuple(c.shape), c.stride(), c.dtype, c.device) for _, c in self._caches}
        if len(shapes) != 1:
            # One calibrated layout serves every layer; hybrid/cross-layer layouts are not supported.
            raise NotImplementedError(f"kvmem needs identical per-layer KV caches, got {shapes}")
        self.rotator = self._layer_rotators()
        self._stream = SideStream(self._caches[0][1].device)
        self._staging = HostStaging(pin=self._stream.is_async)
        self._heads_from_layers(kv_caches)

    def _layer_rotators(self) -> LayerRotators:
        if isinstance(self._rotator_of, KeyRotator):
            return LayerRotators.uniform(self._rotator_of, len(self._caches))
        missing = [name for name, _ in self._caches if name not in self._rotator_of]
        if missing:
            raise NotImplementedError(f"no rotary embedding found for layers {missing}")
        return LayerRotators([self._rotator_of[name] for name, _ in self._caches])

    def _heads_from_layers(self, kv_caches: dict) -> None:
        """The KV head count the attention layers really use: a config can name one the model
        ignores (a GPT-J config with num_key_value_heads), and vLLM's model config believes it."""
        found = {getattr(self._layers.get(name), "num_kv_heads", None) for name in kv_caches} - {None}
        if len(found) > 1:
            raise NotImplementedError(f"kvmem needs one KV head count across layers, got {sorted(found)}")
        if found and found != {self.num_kv_heads}:
            (heads,) = found
            log.warning("the model config says %d KV heads, its attention layers use %d: using the layers'",
                        self.num_kv_heads, heads)
            self.num_kv_heads = heads

    @property
    def device(self) -> torch.device:
        return self._caches[0][1].device

    # -- injection ------------------------------------------------------------------------------

    def load(self, meta: ConnectorMeta) -> None:
        """Queue this step's injections; the engine's stream waits per layer in `wait_layer`."""
        self._layer_events.clear()
        if not meta.loads:
            return
        try:
            self._load(meta.loads)
        except Exception as e:  # noqa: BLE001 - never kill the engine: vLLM recomputes what we report
            log.error("injection failed, blocks will be recomputed: %s", e, exc_info=not _expected(e))
            self._layer_events.clear()
            # Whatever was queued must land before the engine recomputes (and rewrites) those blocks.
            self._stream.make_engine_wait(self._stream.record())
            self.failed_block_ids.update(_blocks_of(meta.loads, self.block_size))

    def _load(self, jobs: list[LoadJob]) -> None:
        positions, slots, key, value = self._stage(jobs)  # host: [N], [N], [L, N, H, D] x 2
        dev = self.device
        with self._stream:
            positions = positions.to(dev, non_blocking=True)
            slots = slots.to(dev, non_blocking=True)
            for i, (name, cache) in enumerate(self._caches):
                k = key[i].to(dev, torch.float32, non_blocking=True)  # [N, H, D]; may alias staging on CPU
                self.rotator.rotate_layer(i, k[None], positions)
                v = value[i].to(dev, non_blocking=True)
                layer = self._layers[name]
                layer.impl.do_kv_cache_update(layer, k.to(cache.dtype), v.to(cache.dtype), cache, slots)
                self._layer_events[name] = self._stream.record()
        self._staging.release(self._stream.record())

    def _stage(self, jobs: list[LoadJob]) -> tuple[torch.Tensor, ...]:
        """Blob tokens of all spans, one after another, in the host staging buffer."""
        positions, slots = _token_map(jobs, self.block_size)
        self.rotator.check_positions(positions)
        spans = [s for job in jobs for s in job.spans]
        blobs = [self.store.get(s.fact_id) for s in spans]
        layers, _, heads, dim = blobs[0].key.shape
        n = len(positions)
        pos_buf, slot_buf, key, value = self._staging.take([
            ((n,), torch.long), ((n,), torch.long),
            ((layers, n, heads, dim), blobs[0].key.dtype), ((layers, n, heads, dim), blobs[0].value.dtype)])
        pos_buf.copy_(positions)
        slot_buf.copy_(slots)
        start = 0
        for span, blob in zip(spans, blobs):
            end = start + span.length
            key[:, start:end] = blob.key[:, span.src : span.src + span.length]
            value[:, start:end] = blob.value[:, span.src : span.src + span.length]
            start = end
        return pos_buf, slot_buf, key, value

    def wait_layer(self, layer_name: str) -> None:
        """Called before a layer's attention: its injected K/V must be in the cache by then."""
        if self._stream is not None:
            self._stream.make_engine_wait(self._layer_events.pop(layer_name, None))

    # -- encoding -------------------------------------------------------------------------------

    def save(self, meta: ConnectorMeta) -> None:
        """Queue the copy of this step's encodes out of the cache; blobs are written off the step."""
        if not meta.saves:
            return
        copied = None
        try:
            copied = self._save(meta.saves)
        except Exception as e:  # noqa: BLE001 - the facts stay without KV (served as text, retried)
            log.error("encoding copy failed for %d requests: %s", len(meta.saves), e, exc_info=not _expected(e))
        for job in meta.saves:
            self._copies[job.req_id] = copied

    def _save(self, jobs: list[SaveJob]):
        positions, slots = _token_map(jobs, self.block_size)
        self.rotator.check_positions(positions)
        keep = any(job.keep_rotated for job in jobs)
        dev = self.device
        self._page_layout()  # calibrated once, on the engine's stream, before the first copy
        with self._stream:
            positions = positions.to(dev, non_blocking=True)
            slots = slots.to(dev, non_blocking=True)
            cached_k, value = self._gather_on_device(slots)  # [L, N, H, D] each, keys rotated, cache dtype
            key = self.rotator.unrotate(cached_k, positions).to(self.key_dtype)  # pre-RoPE
            value = value.to(self.value_dtype or value.dtype)
            host = [_to_host(t, self._stream.is_async) for t in (key, value, *([cached_k] if keep else []))]
            copied = self._stream.record()
        self._writer.submit(SaveBatch(jobs, host[0], host[1], host[2] if keep else None, copied))
        return copied

    def finished(self, finished_req_ids: set[str]) -> set[str]:
        """Of the requests vLLM says are finished, those whose encode copy is done: their blocks
        may be freed. The copy was queued a step ago, so waiting for it here costs next to nothing."""
        done = set()
        for req_id in finished_req_ids:
            if req_id in self._copies:
                synchronize(self._copies.pop(req_id))
                done.add(req_id)
        return done

    def wait_for_copies(self) -> None:
        """Before vLLM reuses blocks it took back (preemption): finish every pending copy out."""
        for event in self._copies.values():
            synchronize(event)

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """slots [N] -> key, value [L, N, H, D] as cached (keys rotated), on the host."""
        key, value = self._gather_on_device(slots.to(self.device, torch.long))
        return key.cpu(), value.cpu()

    def _gather_on_device(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """slots [N] on the cache's device -> key, value [L, N, H, D] as cached, on that device."""
        layout = self._page_layout()
        pairs = [layout.gather(cache, slots) for _, cache in self._caches]
        return torch.stack([k for k, _ in pairs]), torch.stack([v for _, v in pairs])

    def close(self) -> None:
        self.wait_for_copies()
        self._writer.close()

    def _page_layout(self) -> PageLayout:
        if self._layout is None:
            name, cache = self._caches[0]
            layer = self._layers[name]

            def write(k, v, c, s):
                layer.impl.do_kv_cache_update(layer, k, v, c, s)

            self._layout = PageLayout.calibrate(cache, self.num_blocks, self.block_size,
                                                self.num_kv_heads, self.head_size, write)
        return self._layout


def _token_map(jobs: list[LoadJob] | list[SaveJob], block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The jobs' spans, one after another -> prompt positions [N] and cache slots [N] (host int64)."""
    positions, slots = [], []
    for job in jobs:
        p = torch.cat([torch.arange(s.start, s.end) for s in job.spans])
        positions.append(p)
        slots.append(slot_mapping(job.block_ids, p, block_size))
    return torch.cat(positions), torch.cat(slots)


def _blocks_of(jobs: list[LoadJob], block_size: int) -> set[int]:
    blocks = set()
    for job in jobs:
        for s in job.spans:
            blocks.update(job.block_ids[s.start // block_size : (s.end - 1) // block_size + 1])
    return blocks


def _to_host(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """An asynchronous copy into fresh host memory (pinned from torch's caching host allocator)."""
    if t.device.type == "cpu":
        return t  # already a fresh host tensor of its own
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=pin).copy_(t, non_blocking=pin)


def _expected(e: Exception) -> bool:
    """Failures that need no traceback in the log: a blob that went bad, a position out of range."""
    return isinstance(e, (BlobError, ValueError))


def _layer_index(name: str) -> int:
    found = re.findall(r"\.(\d+)\.", name)
    return int(found[0]) if found else 0
