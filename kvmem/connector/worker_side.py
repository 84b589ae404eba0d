"""Worker side of the connector: write injected K/V into the paged cache, read encoded K/V out.

Runs in vLLM's worker process. Every tensor op runs on the paged cache's device; the host only
fills a staging buffer (loads) or receives a finished copy (saves).

Injection, per step: blob tokens are gathered, in their stored (coded) form, into one reusable
(pinned) host staging buffer; then, on a side stream and per layer, they are copied to the
device and decoded, placed (placement.py: the keys of tokens served away from where they were
encoded are moved there with the engine's rotary kernel, tokens that stay put are written
untouched, and the facts of a chat read with the reader adapter go through its KV map), written
with the attention backend's own cache-update op, and an event is recorded. `wait_layer` makes
the engine's stream wait for that layer's event only, so layer i's copy overlaps layer i-1's compute.
On the CPU backend, facts the map applies to are staged already mapped where this worker has
mapped them before (mapped_tier.py).

Encoding, per step: after the forward, on the side stream, the encoded tokens are gathered from
the paged cache as it holds them and copied into host memory; a background thread
(blob_writer.py) codes and writes the blobs. The request's blocks stay allocated until the copy
is done (reported through `finished`).

On vLLM's CPU backend the same code runs synchronously (no streams, no events).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping

import torch

from kvmem.connector.blob_writer import BlobWriter, SaveBatch
from kvmem.connector.mapped_tier import MappedTier
from kvmem.connector.paged import PageLayout
from kvmem.connector.placement import DeviceKVMap, Placement
from kvmem.connector.plan import ConnectorMeta, LoadJob, SaveJob
from kvmem.connector.profile import RequestTimings, Stopwatch
from kvmem.connector.recompute import Recomputer, Rows
from kvmem.connector.rope import KeyRotator, LayerRotators
from kvmem.connector.staged import (Staged, blocks_of, common_dtype, decode_layer, decoded, encoded_positions,
                                    mapped_tokens, stacked_shape, token_map)
from kvmem.connector.staging import HostStaging, SideStream, concat_tokens, synchronize
from kvmem.errors import AdapterError, BlobError
from kvmem.kv.blob import KVBlob
from kvmem.kv.codec import check_codec, decode_parts
from kvmem.kv.store import KVStore
from kvmem.reader.kvmap import KVMap

log = logging.getLogger("kvmem.connector")


class WorkerSide:
    def __init__(self, store: KVStore, rotator: KeyRotator | Mapping[str, KeyRotator], block_size: int, num_blocks: int,
                 num_kv_heads: int, head_size: int, layers: dict, codec: str = "none",
                 kv_map: KVMap | None = None, recompute: Recomputer | str = "no model layers were given") -> None:
        self.store = store
        self._rotator_of = rotator  # one for every layer, or per layer name
        self.rotator: LayerRotators | None = None  # per layer in cache order, once caches are registered
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.codec = check_codec(codec)  # how new blobs are written; any codec is read
        self._layers = layers  # layer name -> attention layer (static forward context)
        self._caches: list[tuple[str, torch.Tensor]] = []
        self._layout: PageLayout | None = None
        self._stream: SideStream | None = None
        self._staging: HostStaging | None = None
        self._work: HostStaging | None = None
        self._layer_events: dict[str, object] = {}  # this step's injection, per layer
        self._copies: dict[str, object] = {}  # req id -> event: its encode's copy out of the cache is done
        self._writer = BlobWriter(store, self.codec)
        self.failed_block_ids: set[int] = set()
        self.tier_counts = {"ram_hits": 0, "disk_loads": 0}  # this worker's blob loads since last reported
        self.watch = Stopwatch()  # this step's injection, by stage (profile.py)
        self.timings = RequestTimings()  # per request, until the step's stats carry them to the scheduler
        self._kv_map = kv_map  # the reader's KV map (reader/kvmap.py), as the adapter gave it
        self._key_map: DeviceKVMap | None = None  # the same, on the device, once registered and checked
        self._mapped_tier: MappedTier | None = None  # blobs mapped once (CPU backend only)
        self.map_refusal: str | None = None  # why the KV map was dropped at registration, if it was
        # The model's layers, for selective recompute; else why recompute cannot drive this model.
        self._recomputer = recompute if isinstance(recompute, Recomputer) else None
        self.recompute_refusal: str | None = None if self._recomputer else recompute

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._caches = sorted(kv_caches.items(), key=lambda kv: layer_index(kv[0]))
        shapes = {(tuple(c.shape), c.stride(), c.dtype, c.device) for _, c in self._caches}
        if len(shapes) != 1:
            # One calibrated layout serves every layer; hybrid/cross-layer layouts are not supported.
            raise NotImplementedError(f"kvmem needs identical per-layer KV caches, got {shapes}")
        self.rotator = self._layer_rotators()
        self._stream = SideStream(self._caches[0][1].device)
        self._staging = HostStaging(pin=self._stream.is_async)
        self._work = HostStaging(pin=False)  # placement's float32 keys and their rounding (CPU backend)
        self._heads_from_layers(kv_caches)
        if self._recomputer is not None and self._recomputer.names != [name for name, _ in self._caches]:
            self._recomputer, self.recompute_refusal = None, "the KV caches are not the attention layers' own"
        if self.recompute_refusal:
            log.info("selective recompute unavailable for this model (plain injection): %s", self.recompute_refusal)
        if self._kv_map is not None and self._map_fits():
            self._key_map = DeviceKVMap.on(self._kv_map, self.device)
            if self.device.type == "cpu" and self.store.hot_limit > 0:
                self._mapped_tier = MappedTier(self._key_map, self.store.hot_limit)

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
            self.failed_block_ids.update(blocks_of(meta.loads, self.block_size))
        finally:
            self.timings.charge((job.req_id for job in meta.loads), self.watch.take())

    def _load(self, jobs: list[LoadJob]) -> None:
        staged = self._stage(jobs)
        with self._stream:
            self._place(staged)
            if self._recomputer is not None and any(j.recompute is not None and j.recompute.on for j in jobs):
                with self.watch.stage("recompute"):
                    self._recompute(jobs, staged)
                done = self._stream.record()  # every layer's slots are final only now
                self._layer_events = dict.fromkeys(self._layer_events, done)
        self._staging.release(self._stream.record())

    def _place(self, staged: Staged) -> None:
        """Write the staged K/V into the paged cache, layer by layer, each where it is served."""
        dev = self.device
        slots = staged.slots.to(dev, non_blocking=True)
        place = Placement.of(staged.src, staged.dst, staged.mapped, self.rotator, self._key_map, dev)
        if dev.type == "cpu":  # staged on the device, no copy to overlap: each pass once over every layer
            with self.watch.stage("placement"):
                keys, values = place.all_layers(decode_parts(staged.key_codec, staged.key),
                                                decode_parts(staged.value_codec, staged.value),
                                                self._caches[0][1].dtype, self._work)
            for i, (name, cache) in enumerate(self._caches):
                layer = self._layers[name]
                with self.watch.stage("scatter"):
                    layer.impl.do_kv_cache_update(layer, keys[i], values[i], cache, slots)
                self._layer_events[name] = self._stream.record()
            return
        for i, (name, cache) in enumerate(self._caches):  # CUDA: layer i's copy overlaps layer i-1's compute
            with self.watch.stage("placement"):
                key = decode_layer(staged.key_codec, staged.key, i, dev)  # [N, H, D]
                value = decode_layer(staged.value_codec, staged.value, i, dev)
                key, value = place.layer(i, key, value, cache.dtype)
            layer = self._layers[name]
            with self.watch.stage("scatter"):
                layer.impl.do_kv_cache_update(layer, key, value, cache, slots)
            self._layer_events[name] = self._stream.record()

    def _recompute(self, jobs: list[LoadJob], staged: Staged) -> None:
        """Recompute the chosen fact tokens of the jobs that ask, one group per setting."""
        caches = [cache for _, cache in self._caches]
        groups: dict = {}
        at = 0
        for job in jobs:
            n = sum(s.length for s in job.spans)
            if job.recompute is not None and job.recompute.on:
                groups.setdefault(job.recompute, []).append((job, at))
            at += n
        for rec, members in groups.items():
            rows = Rows.of_jobs(members, rec, staged.token_ids, staged.dst, staged.slots, self.block_size, self.device)
            if rows is not None:
                self._recomputer.run(rows, caches, self._page_layout())

    def _map_fits(self) -> bool:
        """Keep the reader's KV map only if it fits this model; else drop it (plain KV mode, the
        reason kept in `map_refusal`), as a mismatched adapter is refused, never fatal. Only the
        worker sees the model's real rotary embeddings and head count, so it has the last word."""
        try:
            self._check_map()
        except AdapterError as e:
            log.warning("the reader adapter's KV map is refused, plain KV mode: %s", e)
            self.map_refusal, self._kv_map = str(e), None
            return False
        return True

    def _check_map(self) -> None:
        """The map's complex multiply commutes with RoPE for neox-style pairs (reader/kvmap.py),
        at any base per layer, when it pairs the dims the model rotates as the model does."""
        self._kv_map.check_shape(len(self._caches), self.num_kv_heads, self.head_size)
        rotary_dim = self._kv_map.rotary_dim or self.head_size
        for rot in self.rotator.per_layer:
            if not rot.is_neox_style or rot.rotary_dim != rotary_dim:
                raise AdapterError(f"the reader's KV map pairs neox-style rotary dims over {rotary_dim} of "
                                   f"{self.head_size}; this model has rotary_dim {rot.rotary_dim}, neox "
                                   f"{rot.is_neox_style}")

    def _stage(self, jobs: list[LoadJob]) -> Staged:
        """Blob tokens of all spans, one after another, in the host staging buffer, as stored."""
        positions, slots = token_map(jobs, self.block_size)
        self.rotator.check_positions(positions)
        spans = [s for job in jobs for s in job.spans]
        with self.watch.stage("blob_reads"):
            fetched = [self.store.fetch(s.fact_id) for s in spans]
        with self.watch.stage("staging"):
            return self._gather(jobs, spans, fetched, positions, slots)

    def _gather(self, jobs: list[LoadJob], spans: list, fetched: list, positions: torch.Tensor,
                slots: torch.Tensor) -> Staged:
        """The fetched blobs' span tokens -> one `Staged` in the host staging buffer."""
        blobs = [blob for blob, _ in fetched]
        for _, in_ram in fetched:
            self.tier_counts["ram_hits" if in_ram else "disk_loads"] += 1
        with self.watch.stage("premap"):  # a fact the mapped tier has not seen is mapped now, once
            premapped = self._premapped(jobs, blobs)
        codec = blobs[0].codec if len({b.codec for b in blobs}) == 1 else None
        if codec is None:  # a codec change left blobs of two codecs: decode on the host (rare)
            blobs = [decoded(b) for b in blobs]
            codec = "none"
        n = len(positions)
        wanted = [((n,), torch.long)] + [(stacked_shape(t, n), common_dtype(blobs, role, name))
                                         for role in ("keys", "values")
                                         for name, t in getattr(blobs[0], role).parts.items()]
        buffers = self._staging.take(wanted)
        slot_buf, parts = buffers[0], buffers[1:]
        slot_buf.copy_(slots)
        names = [(role, name) for role in ("keys", "values") for name in getattr(blobs[0], role).parts]
        for (role, name), buf in zip(names, parts):  # one copy op per part: the spans side by side
            concat_tokens([getattr(b, role).parts[name][:, s.src : s.src + s.length] for s, b in zip(spans, blobs)],
                          buf)
        src = encoded_positions(spans, blobs)
        by_role = {"keys": {}, "values": {}}
        for (role, name), buf in zip(names, parts):
            by_role[role][name] = buf
        mapped = mapped_tokens(jobs, positions, premapped) if self._key_map is not None else None
        token_ids = torch.tensor([t for span, blob in zip(spans, blobs)
                                  for t in blob.token_ids[span.src : span.src + span.length]], dtype=torch.long)
        return Staged(codec, slot_buf, by_role["keys"], by_role["values"], src, positions, mapped, token_ids)

    def _premapped(self, jobs: list[LoadJob], blobs: list[KVBlob]) -> list[bool]:
        """Swap in the mapped tier's copy of each blob whose whole span the KV map applies to
        (in place in `blobs`, one per span); -> per span, whether it was."""
        done = [False] * len(blobs)
        if self._mapped_tier is None:
            return done
        spans = [(job, span) for job in jobs for span in job.spans]
        wanted = [i for i, (job, span) in enumerate(spans) if job.map_from is not None and span.start >= job.map_from]
        for i, copy in zip(wanted, self._mapped_tier.get([blobs[i] for i in wanted])):
            if copy is not None:
                blobs[i], done[i] = copy, True
        return done

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
        _, slots = token_map(jobs, self.block_size)
        dev = self.device
        self._page_layout()  # calibrated once, on the engine's stream, before the first copy
        with self._stream:
            slots = slots.to(dev, non_blocking=True)
            key, value = self._gather_on_device(slots)  # [L, N, H, D] each, as cached (keys rotated)
            host = [_to_host(t, self._stream.is_async) for t in (key, value)]
            copied = self._stream.record()
        self._writer.submit(SaveBatch(jobs, host[0], host[1], copied))
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


def _to_host(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """An asynchronous copy into fresh host memory (pinned from torch's caching host allocator)."""
    if t.device.type == "cpu":
        return t  # already a fresh host tensor of its own
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=pin).copy_(t, non_blocking=pin)


def _expected(e: Exception) -> bool:
    """Failures that need no traceback in the log: a blob that went bad, a position out of range."""
    return isinstance(e, (BlobError, ValueError))


def layer_index(name: str) -> int:
    found = re.findall(r"\.(\d+)\.", name)
    return int(found[0]) if found else 0
