"""The KV connector vLLM loads by module path (`kvmem.engine.connector.KvmemConnector`).

vLLM builds one instance per role: the SCHEDULER instance (engine-core process) decides which
prompt tokens are "externally computed" and plans loads/saves; the WORKER instance (worker
process) moves K/V between blobs and the paged cache. The two halves live in
scheduler_side.py and worker_side.py; this class only adapts vLLM's hook names to them.

Everything a worker needs travels in the per-step metadata (ConnectorMeta); configuration comes
from `kv_connector_extra_config`: kv_dir, fingerprint, key_dtype, value_dtype, hot_cache_mib,
is_neox_style.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.config import set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.model_executor.layers.rotary_embedding import get_rope

from kvmem.engine.rope import KeyRotator
from kvmem.engine.scheduler_side import ConnectorMeta, SchedulerSide
from kvmem.engine.worker_side import WorkerSide
from kvmem.kv.store import KVStore


class KvmemMetadata(ConnectorMeta, KVConnectorMetadata):
    pass


class KvmemConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        store = KVStore(extra["kv_dir"], extra["fingerprint"], int(extra.get("hot_cache_mib", 512)) << 20)
        block_size = vllm_config.cache_config.block_size
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(store, block_size)
        else:
            self._worker = _build_worker(vllm_config, kv_cache_config, store, block_size, extra)

    # -- scheduler side -------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = self._scheduler.build_meta(scheduler_output)
        return KvmemMetadata(loads=meta.loads, saves=meta.saves)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return False, self._scheduler.request_finished(request)

    # -- worker side ----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        if self.has_connector_metadata():
            self._worker.load(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are synchronous: done in start_load_kv before the forward pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # saves happen once per step, all layers together, in wait_for_save

    def wait_for_save(self) -> None:
        if self.has_connector_metadata():
            self._worker.save(self._get_connector_metadata())

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._worker.failed_block_ids = self._worker.failed_block_ids, set()
        return failed


def _build_worker(vllm_config, kv_cache_config, store: KVStore, block_size: int, extra: dict) -> WorkerSide:
    model_config = vllm_config.model_config
    hf = model_config.hf_text_config
    head_size = model_config.get_head_size()
    # get_rope builds a CustomOp, which needs the current vLLM config to exist.
    with set_current_vllm_config(vllm_config):
        rope = get_rope(
            head_size,
            max_position=hf.max_position_embeddings,
            is_neox_style=bool(extra.get("is_neox_style", True)),
            rope_parameters=getattr(hf, "rope_parameters", None),
            dtype=model_config.dtype,
        )
    value_dtype = extra.get("value_dtype")
    return WorkerSide(
        store=store,
        rotator=KeyRotator(rope),
        block_size=block_size,
        num_blocks=kv_cache_config.num_blocks,
        num_kv_heads=model_config.get_num_kv_heads(vllm_config.parallel_config),
        head_size=head_size,
        key_dtype=getattr(torch, extra.get("key_dtype", "float32")),
        value_dtype=getattr(torch, value_dtype) if value_dtype else None,
        layers=vllm_config.compilation_config.static_forward_context,
    )
