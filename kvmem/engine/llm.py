"""Starting vLLM with the kvmem connector, and running requests with per-request timings."""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvmem.config import Config
from kvmem.engine.plan import KEY, Plan
from kvmem.errors import EngineError
from kvmem.model import ModelInfo

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineRequest:
    token_ids: tuple[int, ...]
    salt: str  # vLLM cache_salt: prefix-cache blocks are shared only between equal salts
    max_tokens: int = 64
    plan: Plan | None = None
    logprobs: int | None = None  # top-n logprobs per generated token


@dataclass(frozen=True)
class EngineResult:
    token_ids: tuple[int, ...]
    text: str
    ttft_s: float
    latency_s: float
    prompt_tokens: int
    cached_tokens: int  # prompt tokens not prefilled: vLLM prefix-cache hits plus injected ones
    connector: dict[str, Any] = field(default_factory=dict)  # the connector's accounting
    first_logprobs: dict[int, float] = field(default_factory=dict)


class Engine:
    """vLLM's LLMEngine driven step by step, so each request's first token is timed."""

    def __init__(self, model: ModelInfo, config: Config) -> None:
        from vllm import LLM
        from vllm.config import KVTransferConfig

        ec = config.engine
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(ec.cpu_kv_space_gib))
        transfer = KVTransferConfig(
            kv_connector="KvmemConnector",
            kv_connector_module_path="kvmem.engine.connector",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={
                "kv_dir": str(config.kv_dir),
                "fingerprint": model.fingerprint,
                "key_dtype": config.kv.key_dtype,
                "value_dtype": config.kv.value_dtype,
                "hot_cache_mib": config.kv.hot_cache_mib,
            },
        )
        try:
            self._llm = LLM(
                model=str(model.path), dtype=model.dtype, block_size=ec.block_size,
                max_model_len=ec.max_model_len, max_num_seqs=ec.max_num_seqs,
                enable_prefix_caching=True, kv_transfer_config=transfer, seed=ec.seed,
                gpu_memory_utilization=ec.gpu_memory_utilization,
            )
        except Exception as e:  # noqa: BLE001 - vLLM raises many types while starting
            raise EngineError(f"vLLM failed to start on {model.path}: {e}") from e
        self._engine = self._llm.llm_engine
        self._lock = threading.Lock()  # LLMEngine is not thread-safe: one batch at a time
        self.model = model
        self.max_model_len = ec.max_model_len

    @property
    def tokenizer(self):
        return self._llm.get_tokenizer()

    def run(self, requests: list[EngineRequest]) -> list[EngineResult]:
        """Submit all requests at once (the engine batches them) and wait for all of them."""
        with self._lock:
            return self._run(requests)

    def _run(self, requests: list[EngineRequest]) -> list[EngineResult]:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        start = time.perf_counter()
        ids = []
        for req in requests:
            extra = {"kv_transfer_params": req.plan.to_params()} if req.plan else None
            params = SamplingParams(max_tokens=req.max_tokens, temperature=0.0, logprobs=req.logprobs,
                                    extra_args=extra, output_kind=RequestOutputKind.CUMULATIVE)
            rid = uuid.uuid4().hex
            self._engine.add_request(rid, {"prompt_token_ids": list(req.token_ids), "cache_salt": req.salt}, params)
            ids.append(rid)
        first_token: dict[str, float] = {}
        final: dict[str, Any] = {}
        while len(final) < len(ids):
            for out in self._engine.step():
                now = time.perf_counter()
                if out.outputs and out.outputs[0].token_ids and out.request_id not in first_token:
                    first_token[out.request_id] = now
                if out.finished:
                    final[out.request_id] = (out, now)
        return [self._result(*final[rid], first_token.get(rid, final[rid][1]), start) for rid in ids]

    @staticmethod
    def _result(out, done: float, first: float, start: float) -> EngineResult:
        completion = out.outputs[0]
        logprobs = {}
        if completion.logprobs:
            logprobs = {tok: lp.logprob for tok, lp in completion.logprobs[0].items()}
        return EngineResult(
            token_ids=tuple(completion.token_ids),
            text=completion.text,
            ttft_s=first - start,
            latency_s=done - start,
            prompt_tokens=len(out.prompt_token_ids),
            cached_tokens=out.num_cached_tokens or 0,
            connector=(out.kv_transfer_params or {}).get(KEY, {}),
            first_logprobs=logprobs,
        )

    def close(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.engine_core.shutdown()
