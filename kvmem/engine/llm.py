"""Starting vLLM with the kvmem connector, and running requests with per-request timings.

One driver thread owns vLLM's LLMEngine (which is not thread-safe): callers on any thread
submit requests and wait on futures, so concurrent chats and encodes are batched together by
vLLM's scheduler. Time to first token is measured from submission, queueing included.

The connector writes an encode's blobs off the engine step, on a worker-process thread, so an
encode request can finish before its blobs are on disk. Its future resolves once every blob
file of its plan has been replaced (or after BLOB_WAIT_S, when the caller's check finds it
missing): callers keep the simple rule "after run() returns, the blobs are there".
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from kvmem.config import Config
from kvmem.engine.plan import ENCODE, KEY, Plan
from kvmem.errors import EngineError
from kvmem.kv.store import KVStore
from kvmem.model import ModelInfo

log = logging.getLogger(__name__)

BLOB_WAIT_S = 30.0  # a blob write takes milliseconds; only a failed one waits this long


@dataclass(frozen=True)
class EngineRequest:
    token_ids: tuple[int, ...]
    salt: str  # vLLM cache_salt: prefix-cache blocks are shared only between equal salts
    max_tokens: int = 64
    plan: Plan | None = None
    logprobs: int | None = None  # top-n logprobs per generated token
    score_last: int = 0  # >0: return the logprobs of the last n prompt tokens (teacher forcing)


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
    scored: tuple[float, ...] = ()  # logprob of each of the last `score_last` prompt tokens


@dataclass
class _Pending:
    request: EngineRequest
    future: Future
    on_text: Callable[[str], None] | None
    submitted: float
    first_token: float | None = None
    blobs: dict[str, tuple | None] = field(default_factory=dict)  # encode: fact id -> file stamp before it
    finished: tuple | None = None  # (output, time) once vLLM finished it, while its blobs are awaited


class Engine:
    def __init__(self, model: ModelInfo, config: Config) -> None:
        ec = config.engine
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(ec.cpu_kv_space_gib))
        try:
            self._llm = _start_llm(model, config)
        except Exception as e:  # noqa: BLE001 - vLLM raises many types while starting
            raise EngineError(f"vLLM failed to start on {model.path}: {e}") from e
        self._engine = self._llm.llm_engine
        self.model = model
        self.max_model_len = ec.max_model_len
        self._blobs = KVStore(config.kv_dir, model.fingerprint, hot_cache_bytes=0)
        self._inbox: queue.Queue[_Pending | None] = queue.Queue()
        self._stopping = False
        self._driver = threading.Thread(target=self._drive, name="kvmem-engine", daemon=True)
        self._driver.start()

    @property
    def tokenizer(self):
        return self._llm.get_tokenizer()

    def submit(self, request: EngineRequest, on_text: Callable[[str], None] | None = None) -> Future:
        """Queue one request; the future resolves to its EngineResult. on_text gets the text so far."""
        if self._stopping:
            raise EngineError("the engine is shut down")
        future: Future = Future()
        plan = request.plan
        blobs = {s.fact_id: self._blobs.stamp(s.fact_id) for s in plan.segments} if plan and plan.op == ENCODE else {}
        self._inbox.put(_Pending(request, future, on_text, time.perf_counter(), blobs=blobs))
        return future

    def run(self, requests: list[EngineRequest]) -> list[EngineResult]:
        """Submit all requests at once (the engine batches them) and wait for all of them."""
        return [f.result() for f in [self.submit(r) for r in requests]]

    def stream(self, request: EngineRequest) -> Iterator[str | EngineResult]:
        """Text deltas as they are generated, then the EngineResult."""
        texts: queue.Queue[str] = queue.Queue()
        future = self.submit(request, texts.put)
        sent = ""
        while True:
            try:
                text = texts.get(timeout=0.05)
            except queue.Empty:
                if future.done():
                    break
                continue
            if len(text) > len(sent):
                yield text[len(sent):]
                sent = text
        result = future.result()
        if len(result.text) > len(sent):
            yield result.text[len(sent):]
        yield result

    # -- the driver thread ----------------------------------------------------------------------

    def _drive(self) -> None:
        live: dict[str, _Pending] = {}
        awaiting: list[_Pending] = []  # finished encodes whose blobs are still being written
        while not self._stopping:
            try:
                self._admit(live, block=not live and not awaiting)
                if live:
                    self._step(live, awaiting)
                elif awaiting:
                    time.sleep(0.001)
                awaiting[:] = [p for p in awaiting if not self._resolve_if_written(p)]
            except Exception as e:  # noqa: BLE001 - fail the waiting callers, keep serving
                log.exception("engine step failed")
                for p in live.values():
                    p.future.set_exception(EngineError(f"engine step failed: {e}"))
                live.clear()
        for p in [*live.values(), *awaiting]:
            p.future.set_exception(EngineError("the engine shut down before answering"))

    def _admit(self, live: dict[str, _Pending], block: bool) -> None:
        while True:
            try:
                item = self._inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            if item is None:
                return
            block = False
            rid = uuid.uuid4().hex
            try:
                self._engine.add_request(rid, _prompt(item.request), _sampling(item.request))
                live[rid] = item
            except Exception as e:  # noqa: BLE001 - a bad request fails alone
                item.future.set_exception(e)

    def _step(self, live: dict[str, _Pending], awaiting: list[_Pending]) -> None:
        for out in self._engine.step():
            p = live.get(out.request_id)
            if p is None:
                continue
            now = time.perf_counter()
            if p.first_token is None and out.outputs and out.outputs[0].token_ids:
                p.first_token = now
            if p.on_text is not None and out.outputs:
                p.on_text(out.outputs[0].text)
            if out.finished:
                del live[out.request_id]
                p.finished = (out, now)
                if not self._resolve_if_written(p):
                    awaiting.append(p)

    def _resolve_if_written(self, p: _Pending) -> bool:
        """Resolve p's future once each of its blob files is a new one (or its wait ran out)."""
        out, done = p.finished
        changed = all(self._blobs.stamp(f) not in (None, before) for f, before in p.blobs.items())
        if not changed and time.perf_counter() < done + BLOB_WAIT_S:
            return False
        try:
            p.future.set_result(_result(out, p, done))
        except Exception as e:  # noqa: BLE001 - the caller must hear of it, never hang
            p.future.set_exception(e)
        return True

    def close(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        self._inbox.put(None)
        self._driver.join(timeout=60)
        self._engine.engine_core.shutdown()


def _start_llm(model: ModelInfo, config: Config):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    ec = config.engine
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
    return LLM(
        model=str(model.path), dtype=model.dtype, block_size=ec.block_size, max_model_len=ec.max_model_len,
        max_num_seqs=ec.max_num_seqs, enable_prefix_caching=True, kv_transfer_config=transfer, seed=ec.seed,
        gpu_memory_utilization=ec.gpu_memory_utilization, load_format=ec.load_format, enforce_eager=ec.enforce_eager,
    )


def _prompt(req: EngineRequest) -> dict:
    return {"prompt_token_ids": list(req.token_ids), "cache_salt": req.salt}


def _sampling(req: EngineRequest):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    extra = {"kv_transfer_params": req.plan.to_params()} if req.plan else None
    # Scoring keeps the prefix cache (and so injection) on. Prompt positions served from cache get
    # no logprobs: vLLM fills them with placeholder ids that must not be detokenized.
    scoring = {"prompt_logprobs": 0, "skip_reading_prefix_cache": False, "detokenize": False} if req.score_last else {}
    return SamplingParams(max_tokens=req.max_tokens, temperature=0.0, logprobs=req.logprobs, extra_args=extra,
                          output_kind=RequestOutputKind.CUMULATIVE, **scoring)


def _result(out, p: _Pending, done: float) -> EngineResult:
    completion = out.outputs[0]
    logprobs = {tok: lp.logprob for tok, lp in completion.logprobs[0].items()} if completion.logprobs else {}
    return EngineResult(
        token_ids=tuple(completion.token_ids),
        text=completion.text,
        ttft_s=(p.first_token or done) - p.submitted,
        latency_s=done - p.submitted,
        prompt_tokens=len(out.prompt_token_ids),
        cached_tokens=out.num_cached_tokens or 0,
        connector=(out.kv_transfer_params or {}).get(KEY, {}),
        first_logprobs=logprobs,
        scored=_scored(out, p.request) if p.request.score_last else (),
    )


def _scored(out, req: EngineRequest) -> tuple[float, ...]:
    """Logprobs of the last n prompt tokens, each under the tokens before it."""
    ids = out.prompt_token_ids[-req.score_last:]
    entries = (out.prompt_logprobs or [])[-req.score_last:]
    if len(entries) != len(ids) or any(e is None or t not in e for e, t in zip(entries, ids)):
        raise EngineError("prompt logprobs missing for the scored tokens (were they served from cache?)")
    return tuple(e[t].logprob for e, t in zip(entries, ids))
