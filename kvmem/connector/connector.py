"""The KV connector vLLM loads by module path (`kvmem.connector.connector.KvmemConnector`).

vLLM builds one instance per role: the SCHEDULER instance (engine-core process) decides which
prompt tokens are "externally computed" and plans loads/saves; the WORKER instance (worker
process) moves K/V between blobs and the paged cache. The two halves live in
scheduler_side.py and worker_side.py; this class only adapts vLLM's hook names to them, and
refuses at construction what kvmem cannot serve (support.py).

Everything a worker needs travels in the per-step metadata (plan.ConnectorMeta); configuration
comes from `kv_connector_extra_config`, read as a plan.ConnectorSettings (its fields and defaults
are documented there). A reader adapter's KV map that does not fit the model is dropped by the
worker, which says why in kv_dir; the scheduler side then reports no chat mapped. Each finished
inject request carries a plan.InjectionReport back in its kv_transfer_params.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import torch
from vllm.config import set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.model_executor.layers import rotary_embedding
from vllm.model_executor.layers.rotary_embedding import get_rope

from kvmem.connector.plan import ConnectorMeta, ConnectorSettings
from kvmem.connector.profile import StepClock, to_ms
from kvmem.connector.recompute import Recomputer, live_modules
from kvmem.connector.rope import KeyRotator, is_rotary
from kvmem.connector.scheduler_side import SchedulerSide
from kvmem.connector.support import leave_map_refusal, map_refused, refuse_unsupported
from kvmem.connector.worker_side import WorkerSide, layer_index
from kvmem.connector.residency import ResidencyPublisher
from kvmem.kv.store import KVStore
from kvmem.reader import kvmap

log = logging.getLogger("kvmem.connector")

PROFILE = "profile"  # the stats' key for per-request stage timings


class KvmemMetadata(ConnectorMeta, KVConnectorMetadata):
    pass


class KvmemStats(KVConnectorStats):
    """What a worker reports after each step: blob loads served by its RAM tier, and read from
    disk; and under PROFILE, each injecting request's stage seconds (profile.py)."""

    def reset(self) -> None:
        self.data = {"ram_hits": 0, "disk_loads": 0}

    def aggregate(self, other: KVConnectorStats) -> "KvmemStats":
        for name, value in other.data.items():
            if name == PROFILE:
                self.data.setdefault(PROFILE, {}).update(value)
            else:
                self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: value for name, value in self.data.items() if name != PROFILE}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KvmemConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        settings = ConnectorSettings.from_params(self._kv_transfer_config.kv_connector_extra_config)
        refuse_unsupported(vllm_config, kv_cache_config, report_dir=settings.kv_dir)
        # One store for both halves when they share a process, so the scheduler's checks fill
        # the RAM tier that the worker then reads.
        store = KVStore.shared(settings.kv_dir, settings.fingerprint, settings.hot_cache_mib << 20,
                               shared_url=settings.shared_url)
        block_size = vllm_config.cache_config.block_size
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._clock: StepClock | None = None  # worker: the injecting step around the load
        self._publisher: ResidencyPublisher | None = None
        self._tier_totals = KvmemStats()  # scheduler: every worker's reports, summed
        self._tier_totals.reset()
        self._settings = settings
        if role == KVConnectorRole.SCHEDULER:
            # The worker registered its caches (and judged the map) before this side is built.
            mapping = kvmap.load(settings.reader_adapter) is not None \
                and map_refused(settings.kv_dir, settings.fingerprint) is None
            recompute = map_refused(settings.kv_dir, settings.fingerprint, "recompute") is None
            self._scheduler = SchedulerSide(store, block_size, kv_map=mapping, recompute=recompute)
        else:
            store.worker_attached = True
            self._worker = _build_worker(vllm_config, kv_cache_config, store, block_size, settings)
            self._clock = StepClock(self._worker.timings)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Injection waits per layer (wait_for_layer_load), which a full CUDA graph would skip."""
        return True

    # -- scheduler side (engine-core process) ---------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Scheduler, while admitting a waiting request (maybe several times): how many prompt
        tokens after the local prefix-cache hit we supply. Loads are synchronous (False)."""
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        """Scheduler, once blocks are allocated for a request we claimed tokens of."""
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        """Scheduler, once per step after scheduling: this step's loads and saves for the worker."""
        meta = self._scheduler.build_meta(scheduler_output)
        return KvmemMetadata(**vars(meta))  # every field: one left out here reached the worker as its default

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Scheduler, once per finished request, before its blocks are freed: True keeps them
        until the worker reports the request in get_finished (an encode still being copied)."""
        delay, report = self._scheduler.request_finished(request)
        if report is None:
            return delay, None
        # RAM-tier totals as of the last step (a request's own loads may lag a step).
        totals = self._tier_totals.data
        report = replace(report, ram_tier_hits=totals.get("ram_hits", 0), ram_tier_loads=totals.get("disk_loads", 0),
                         profile_ms=to_ms(self._scheduler.timings.pop(request.request_id)))
        return delay, report.to_params()

    def update_connector_output(self, connector_output) -> None:
        """Scheduler, each step, with what the workers reported (encodes whose copy is done)."""
        self._scheduler.copies_done(connector_output.finished_sending or ())
        stats = connector_output.kv_connector_stats
        if stats is not None:
            self._scheduler.timings.merge(stats.data.pop(PROFILE, {}))
            self._tier_totals.aggregate(stats)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        """Any process: rebuild stats that crossed a process boundary as a dict."""
        return KvmemStats(data=dict(data)) if data is not None else None

    # -- worker side (worker process) -----------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Worker, once at start-up, after the paged caches are allocated (and before the
        scheduler side is built, which reads the worker's verdict on the reader's KV map)."""
        self._worker.register_kv_caches(kv_caches)
        # The RAM tier is the worker's (vLLM's CPU backend runs it apart from the scheduler); one
        # summary per replica, from its first worker.
        if self._settings.shared_url and self._settings.replica_url and _first_worker():
            self._publisher = ResidencyPublisher(self._worker.store, self._settings.shared_url,
                                                 self._settings.replica_url)
        leave_map_refusal(self._settings.kv_dir, self._settings.fingerprint, self._worker.recompute_refusal,
                          "recompute")
        if self._settings.reader_adapter:
            leave_map_refusal(self._settings.kv_dir, self._settings.fingerprint, self._worker.map_refusal)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        """Worker, each step, before the forward pass: queue this step's injections."""
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            loading = [job.req_id for job in meta.loads]
            self._clock.load_started(loading, meta.built_at)
            self._worker.load(meta)
            self._clock.load_done(loading)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Worker, inside the forward pass, before each attention layer: that layer's injected
        K/V must be in the cache (a device-side wait on its event; no host sync)."""
        self._worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        """Worker, after each attention layer: nothing; encodes are copied once per step."""
        return

    def wait_for_save(self) -> None:
        """Worker, each step, after the forward pass: queue the copy of finished encodes out of
        the cache (blobs are written on a background thread)."""
        self._clock.forward_done()
        if self.has_connector_metadata():
            self._worker.save(self._get_connector_metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Worker, each step, after wait_for_save: encodes whose copy is done (their blocks may
        be freed); we never load asynchronously, so nothing is ever 'received'."""
        return self._worker.finished(finished_req_ids) or None, None

    def handle_preemptions(self, kv_connector_metadata) -> None:
        """Worker, before a step that reuses blocks of preempted requests: finish copies out."""
        self._worker.wait_for_copies()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Worker, each step after the forward pass: blob loads since the last call, by tier, and
        the injecting requests' stage timings."""
        if self._worker is None:
            return None
        timings = self._worker.timings.drain()
        if not any(self._worker.tier_counts.values()) and not timings:
            return None
        stats = KvmemStats(data=dict(self._worker.tier_counts))
        if timings:
            stats.data[PROFILE] = timings
        self._worker.tier_counts = dict.fromkeys(self._worker.tier_counts, 0)
        return stats

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Worker, each step: blocks whose injection failed; vLLM recomputes them."""
        failed, self._worker.failed_block_ids = self._worker.failed_block_ids, set()
        return failed

    def shutdown(self) -> None:
        """Worker and scheduler, at engine shutdown: write out every blob still queued; withdraw
        the residency summary."""
        if self._worker is not None:
            self._worker.close()
        if self._publisher is not None:
            self._publisher.close()


def _first_worker() -> bool:
    """This worker is rank 0 of the engine's workers (the only one, without parallelism)."""
    from vllm.distributed.parallel_state import get_world_group

    try:
        return get_world_group().rank_in_group == 0
    except AssertionError:  # no distributed group (a worker built outside vLLM's executor)
        return True


def _build_worker(vllm_config, kv_cache_config, store: KVStore, block_size: int,
                  settings: ConnectorSettings) -> WorkerSide:
    model_config = vllm_config.model_config
    head_size = model_config.get_head_size()
    layers = vllm_config.compilation_config.static_forward_context
    attention = {name: layer for name, layer in layers.items() if hasattr(layer, "impl")}
    modules = live_modules()
    return WorkerSide(
        store=store,
        rotator=_layer_rotators(vllm_config, attention, modules, head_size, settings.is_neox_style),
        block_size=block_size,
        num_blocks=kv_cache_config.num_blocks,
        num_kv_heads=model_config.get_num_kv_heads(vllm_config.parallel_config),
        head_size=head_size,
        codec=settings.codec,
        layers=layers,
        kv_map=kvmap.load(settings.reader_adapter),
        recompute=Recomputer.find(attention, sorted(attention, key=layer_index), modules),
    )


def _layer_rotators(vllm_config, attention: dict, modules: list, head_size: int,
                    is_neox_style: bool) -> KeyRotator | dict[str, KeyRotator]:
    """Each attention layer's own rotary embedding (Gemma 3's local and global layers differ in
    base), taken from the loaded model; else the model's single one for every layer."""
    ropes = _sibling_ropes(attention, modules)
    if attention and ropes.keys() == attention.keys():
        shared: dict[int, KeyRotator] = {}
        return {name: shared.setdefault(id(rope), KeyRotator(rope)) for name, rope in ropes.items()}
    return KeyRotator(_model_rope(vllm_config, head_size, is_neox_style))


def _sibling_ropes(layers: dict[str, torch.nn.Module], modules: list[torch.nn.Module]) -> dict[str, torch.nn.Module]:
    """layer name -> the rotary embedding held beside it by its parent module (vLLM's attention
    modules keep `rotary_emb` next to `attn`), the parents found among the live `modules`."""
    wanted = {id(layer): name for name, layer in layers.items()}
    found = {}
    for obj in modules:
        if not obj._modules:
            continue
        children = [c for c in obj._modules.values() if c is not None]
        names = [wanted[id(c)] for c in children if id(c) in wanted]
        ropes = [c for c in children if is_rotary(c)]
        if names and len(ropes) == 1:
            found.update(dict.fromkeys(names, ropes[0]))
    return found


def _model_rope(vllm_config, head_size: int, is_neox_style: bool):
    """The rotary embedding the model itself uses (its style, scaling and table), else one built
    from the config. The worker connector is built after the model is loaded, and vLLM's
    get_rope caches every instance it builds, so the model's own is found there."""
    built = {id(r): r for r in rotary_embedding._ROPE_DICT.values() if getattr(r, "head_size", None) == head_size}
    if len(built) == 1:
        return next(iter(built.values()))
    if len(built) > 1:
        styles = {(type(r).__name__, r.rotary_dim) for r in built.values()}
        raise NotImplementedError(f"the model uses {len(built)} different rotary embeddings ({styles}); kvmem needs one")
    hf = vllm_config.model_config.hf_text_config
    log.warning("model's rotary embedding not found; building one from the config (is_neox_style=%s)",
                is_neox_style)
    with set_current_vllm_config(vllm_config):  # get_rope builds a CustomOp, which needs the config
        return get_rope(
            head_size,
            max_position=hf.max_position_embeddings,
            is_neox_style=is_neox_style,
            rope_parameters=getattr(hf, "rope_parameters", None),
            dtype=vllm_config.model_config.dtype,
        )
