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
import sys
import threading
import time
import uuid
from concurrent.futures import FIRST_EXCEPTION, Future, InvalidStateError, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from kvmem.config import Config
from kvmem.connector.plan import ENCODE, InjectionReport
from kvmem.engine.protocol import BLOB_WAIT_S, ChoiceDelta, Completion, EngineRequest, EngineResult, EngineStatus
from kvmem.engine.replica import engine_settings
from kvmem.connector.support import map_refused, take_refusal
from kvmem.errors import EngineError, InvalidInputError, RequestCancelled, UnsupportedConfigError
from kvmem.kv.store import KVStore
from kvmem.model import ModelInfo
from kvmem.reader import adapters
from kvmem.reader.lora import has_lora
from kvmem.results import TokenLogprob

log = logging.getLogger(__name__)

CANCEL_POLL_S = 0.05  # how often a waiting caller looks at its cancel event
CORE_WATCH_S = 0.5  # how often the engine-core process's liveness is looked at


@dataclass
class _Pending:
    request: EngineRequest
    future: Future
    on_text: Callable[[int, str], None] | None  # (completion index, its text so far)
    submitted: float
    first_token: float | None = None
    blobs: dict[str, tuple | None] = field(default_factory=dict)  # encode: fact id -> file stamp before it
    finished: tuple | None = None  # (output, time) once vLLM finished it, while its blobs are awaited
    outputs: dict = field(default_factory=dict)  # completion index -> its latest (cumulative) output


class LocalEngine:
    """vLLM in this process (protocol.Engine)."""

    def __init__(self, model: ModelInfo, config: Config) -> None:
        ec = config.engine
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(ec.cpu_kv_space_gib))
        take_refusal(config.kv_dir)  # a stale one from an earlier start must not be blamed
        self.reader_adapter = adapters.find(config.kv.reader_adapter, config.home, model.fingerprint)
        self._lora = _lora_request(self.reader_adapter)
        try:
            self._llm = _start_llm(model, config, self.reader_adapter)
        except Exception as e:  # noqa: BLE001 - vLLM raises many types while starting
            refusal = take_refusal(config.kv_dir)
            if refusal:
                raise UnsupportedConfigError(f"{refusal} (model {model.path})") from e
            raise EngineError(f"vLLM failed to start on {model.path}: {e}") from e
        self._refuse_unfit_adapter(config.kv_dir, model.fingerprint)
        self._engine = self._llm.llm_engine
        self.model = model
        self.max_model_len = ec.max_model_len
        self._blobs = KVStore(config.kv_dir, model.fingerprint, hot_cache_bytes=0, shared_url=config.kv.shared_url)
        self._inbox: queue.Queue[_Pending | None] = queue.Queue()
        self._stopping = False
        self.aborted = 0  # requests dropped because their caller cancelled them (e.g. a client hung up)
        self._driver = threading.Thread(target=self._drive, name="kvmem-engine", daemon=True)
        self._driver.start()
        self.dead = False  # vLLM's engine-core process died: this engine serves no more (the server restarts it)
        threading.Thread(target=self._watch_core, name="kvmem-engine-watch", daemon=True).start()

    def _refuse_unfit_adapter(self, kv_dir: Path, fingerprint: str) -> None:
        """A KV map that does not fit the model (its shape, or a rotary embedding it does not
        commute with) was dropped by the worker at start-up: the whole adapter is refused then,
        as a malformed one is, and KV-mode chats are served plainly."""
        refusal = map_refused(kv_dir, fingerprint) if self.reader_adapter is not None else None
        if refusal:
            log.warning("reader adapter %s refused, plain KV mode: %s", self.reader_adapter, refusal)
            self.reader_adapter, self._lora = None, None

    @property
    def tokenizer(self):
        return self._llm.get_tokenizer()

    def submit(self, request: EngineRequest, on_text: Callable[[int, str], None] | None = None) -> Future:
        """Queue one request; the future resolves to its EngineResult. on_text gets a completion's
        index and its text so far."""
        if self._stopping:
            raise EngineError("the engine is shut down")
        if self.dead:
            raise EngineError("vLLM's engine process died; the engine is restarting")
        future: Future = Future()
        plan = request.plan
        blobs = {s.fact_id: self._blobs.stamp(s.fact_id) for s in plan.segments} if plan and plan.op == ENCODE else {}
        self._inbox.put(_Pending(request, future, on_text, time.perf_counter(), blobs=blobs))
        return future

    def run(self, requests: list[EngineRequest], cancel: threading.Event | None = None) -> list[EngineResult]:
        """Submit all requests at once (the engine batches them) and wait for all of them.

        Setting `cancel` aborts those not finished yet (their KV blocks are freed) and raises
        RequestCancelled.
        """
        futures = [self.submit(r) for r in requests]
        while cancel is not None:
            done, pending = wait(futures, timeout=CANCEL_POLL_S, return_when=FIRST_EXCEPTION)
            if not pending or any(f.exception() for f in done):
                break
            if cancel.is_set():
                self.cancel(futures)
                raise RequestCancelled(f"{len(pending)} of {len(futures)} requests cancelled before they finished")
        return [f.result() for f in futures]

    def encode(self, requests: list[EngineRequest]) -> None:
        """Run ENCODE requests; run() already waits for their blob files."""
        self.run(requests)

    def health(self) -> bool:
        return not self._stopping and not self.dead and self._driver.is_alive()

    def status(self) -> EngineStatus:
        adapter = str(self.reader_adapter) if self.reader_adapter is not None else None
        return EngineStatus("local", self.health(), adapter, self.aborted)

    def cancel(self, futures: list[Future]) -> None:
        """Abort these requests in the engine (the driver does it before its next step)."""
        for f in futures:
            f.cancel()

    def stream(self, request: EngineRequest,
               cancel: threading.Event | None = None) -> Iterator[str | ChoiceDelta | EngineResult]:
        """Text deltas as they are generated (str; ChoiceDelta when n > 1), then the EngineResult.

        Closing the generator early, or setting `cancel`, aborts the request in the engine.
        """
        texts: queue.Queue[tuple[int, str]] = queue.Queue()
        future = self.submit(request, lambda index, text: texts.put((index, text)))
        sent: dict[int, str] = {}
        try:
            while True:
                if cancel is not None and cancel.is_set():
                    raise RequestCancelled("the stream was cancelled before it finished")
                try:
                    index, text = texts.get(timeout=CANCEL_POLL_S)
                except queue.Empty:
                    if future.done():
                        break
                    continue
                yield from _delta(request, index, text, sent)
        finally:
            if not future.done():
                future.cancel()
        result = future.result()
        for c in result.choices:
            yield from _delta(request, c.index, c.text, sent)
        yield result

    def _watch_core(self) -> None:
        """Runs on its own thread. vLLM notices its engine-core process die (and marks its client
        dead), but a step already waiting for that process's output waits forever, and with it
        every request in flight. Once the core is gone the wait is woken with vLLM's own
        EngineDeadError, so those requests fail (EngineError: a 503) and new ones are refused."""
        from vllm.v1.engine.exceptions import EngineDeadError

        core = self._engine.engine_core
        resources = getattr(core, "resources", None)  # an in-process core (no child to lose) has none
        while resources is not None and not self._stopping:
            if resources.engine_dead:
                if self._stopping:  # close() shuts the core down too: not a death
                    return
                self.dead = True
                log.error("vLLM's engine-core process died: failing the requests in flight")
                outputs = getattr(core, "outputs_queue", None)
                if outputs is not None:
                    outputs.put_nowait(EngineDeadError())
                return
            time.sleep(CORE_WATCH_S)

    # -- the driver thread ----------------------------------------------------------------------

    def _drive(self) -> None:
        live: dict[str, _Pending] = {}
        awaiting: list[_Pending] = []  # finished encodes whose blobs are still being written
        while not self._stopping:
            try:
                self._admit(live, block=not live and not awaiting)
                self._abort_cancelled(live)
                if live:
                    self._step(live, awaiting)
                elif awaiting:
                    time.sleep(0.001)
                awaiting[:] = [p for p in awaiting if not self._resolve_if_written(p)]
            except Exception as e:  # noqa: BLE001 - fail the waiting callers, keep serving
                log.exception("engine step failed")
                self._abort(list(live))  # or they would hold KV blocks and be stepped for nobody
                for p in live.values():
                    _fail(p.future, EngineError(f"engine step failed: {e}"))
                live.clear()
        for p in [*live.values(), *awaiting]:
            _fail(p.future, EngineError("the engine shut down before answering"))

    def _abort_cancelled(self, live: dict[str, _Pending]) -> None:
        gone = [rid for rid, p in live.items() if p.future.cancelled()]
        if gone:
            self.aborted += len(gone)  # counted first: once vLLM drops them, the count already says so
            self._abort(gone)
            for rid in gone:
                del live[rid]
            log.info("aborted %d cancelled request(s)", len(gone))

    def _abort(self, request_ids: list[str]) -> None:
        if not request_ids:
            return
        try:
            self._engine.abort_request(request_ids)
        except Exception:  # noqa: BLE001 - a broken engine cannot abort; the callers still hear
            log.exception("aborting %d request(s) failed", len(request_ids))

    def _admit(self, live: dict[str, _Pending], block: bool) -> None:
        while True:
            try:
                item = self._inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            if item is None:
                return
            block = False
            if item.future.cancelled():
                self.aborted += 1  # cancelled before it reached the engine
                continue
            rid = uuid.uuid4().hex
            try:
                reading = item.request.reader and self.reader_adapter is not None
                self._engine.add_request(rid, _prompt(item.request, reading), _sampling(item.request, reading),
                                         lora_request=self._lora if reading else None)
                live[rid] = item
            except Exception as e:  # noqa: BLE001 - a bad request fails alone
                _fail(item.future, _refused(item.request, e))

    def _step(self, live: dict[str, _Pending], awaiting: list[_Pending]) -> None:
        for out in self._engine.step():
            p = live.get(out.request_id)
            if p is None:
                continue
            now = time.perf_counter()
            for o in out.outputs:  # one child's completion per output when n > 1 (vLLM's parallel sampling)
                p.outputs[o.index] = o
                if p.first_token is None and o.token_ids:
                    p.first_token = now
                if p.on_text is not None:
                    p.on_text(o.index, o.text)
            if out.finished:
                del live[out.request_id]
                p.finished = (out, now)
                if not self._resolve_if_written(p):
                    awaiting.append(p)

    def _resolve_if_written(self, p: _Pending) -> bool:
        """Resolve p's future once each of its blob files is a new one (or its wait ran out)."""
        out, done = p.finished
        if p.future.cancelled():
            return True  # nobody waits for it any more
        changed = all(self._blobs.stamp(f) not in (None, before) for f, before in p.blobs.items())
        if not changed and time.perf_counter() < done + BLOB_WAIT_S:
            return False
        try:
            result = _result(out, p, done)
        except Exception as e:  # noqa: BLE001 - the caller must hear of it, never hang
            _fail(p.future, e)
            return True
        try:
            p.future.set_result(result)
        except InvalidStateError:  # cancelled meanwhile: nobody is waiting
            pass
        return True

    def reset_prefix_cache(self) -> bool:
        """Drop the engine's own prefix cache (benchmarks: one run must not ride another's cached
        blocks). Call it with no request in flight; False if vLLM refused (requests running)."""
        return self._engine.reset_prefix_cache()

    def close(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        self._inbox.put(None)
        self._driver.join(timeout=60)
        self._engine.engine_core.shutdown()
        self._blobs.close()


def _refused(request: EngineRequest, error: Exception) -> Exception:
    """vLLM's refusal of the request itself (VLLMClientError, its 4xx), as the caller's bad input:
    a schema its structured-output backend cannot compile is the caller's response_format."""
    from vllm.exceptions import VLLMClientError
    from vllm.v1.engine.exceptions import EngineDeadError

    if isinstance(error, EngineDeadError):  # the engine's failure, not the request's: a 503
        return EngineError(f"vLLM's engine process died: {error}")
    if not isinstance(error, (VLLMClientError, ValueError)):
        return error
    if request.sampling.structured:
        return InvalidInputError(f"the JSON schema cannot be used: {error}", param=request.sampling.schema_from)
    return InvalidInputError(f"the engine refused the request: {error}", param=getattr(error, "parameter", None))


def _delta(request: EngineRequest, index: int, text: str, sent: dict[int, str]) -> Iterator[str | ChoiceDelta]:
    """The new part of completion `index`'s text (str when the request has one completion)."""
    before = sent.get(index, "")
    if len(text) > len(before):
        sent[index] = text
        new = text[len(before):]
        yield new if request.sampling.n == 1 else ChoiceDelta(index, new)


def _fail(future: Future, error: BaseException) -> None:
    """Fail a caller's future unless it was cancelled meanwhile (then nobody is waiting)."""
    try:
        future.set_exception(error)
    except InvalidStateError:
        pass


def _lora_request(adapter: Path | None):
    if adapter is None or not has_lora(adapter):
        return None
    from vllm.lora.request import LoRARequest

    return LoRARequest("kvmem-reader", 1, str(adapter))


def _start_llm(model: ModelInfo, config: Config, adapter: Path | None):
    from vllm import LLM
    from vllm.config import KVTransferConfig
    from vllm.platforms import current_platform

    kwargs = engine_settings(config, model, adapter, cpu=current_platform.is_cpu())  # what a replica gets
    kwargs["kv_transfer_config"] = KVTransferConfig(**kwargs["kv_transfer_config"])
    with _children_skip_main_script():
        return LLM(**kwargs)


@contextmanager
def _children_skip_main_script() -> Iterator[None]:
    """Start vLLM's processes without running the caller's main script in them.

    vLLM starts its engine-core process (which starts the workers) with multiprocessing's
    "spawn", and spawn first runs the parent's main script (or `-m` module) again in the child.
    A user's script that makes a KVMem at top level, as the README shows, then makes one in the
    child too, and multiprocessing aborts the start. With an `if __name__ == "__main__":` guard,
    its imports still run there, and on the CPU backend a worker that has loaded numba (kvmem's
    index kernels do; so may the script) dies at start: vLLM's Triton-override scan
    (vllm/triton_utils/dispatcher.py) calls `vars()` on every module global, and llvmlite's
    `lib` answers with a wrapped function instead of a dict. vLLM's processes need nothing from
    the script (what they run is imported by module name), so spawn is told there is none: the
    main module's `__file__` and `__spec__` are hidden while vLLM starts, and put back after.
    """
    main = sys.modules.get("__main__")
    names = vars(main) if main is not None else {}
    saved = {name: names[name] for name in ("__file__", "__spec__") if name in names}
    names.pop("__file__", None)  # spawn reads both with getattr: absent / None mean "no main to run"
    if "__spec__" in saved:
        names["__spec__"] = None
    try:
        yield
    finally:
        names.update(saved)


def _prompt(req: EngineRequest, reading: bool = False) -> dict:
    """`reading`: the request reads with the reader adapter. Its KV-mode blocks (KV map applied)
    must not be shared with requests that read without it, LoRA or not: a salt of their own."""
    return {"prompt_token_ids": list(req.token_ids), "cache_salt": req.salt + (":reader" if reading else "")}


def _sampling(req: EngineRequest, reading: bool = False):
    """vLLM's sampling parameters; `reading`: the request reads with the reader adapter (its LoRA,
    if it has one), so the connector also sends its facts through the adapter's KV map."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    extra = {"kv_transfer_params": req.plan.read_with_reader(reading).to_params()} if req.plan else None
    # Scoring keeps the prefix cache (and so injection) on. Prompt positions served from cache get
    # no logprobs: vLLM fills them with placeholder ids that must not be detokenized.
    scoring = {"prompt_logprobs": 0, "skip_reading_prefix_cache": False, "detokenize": False} if req.score_last else {}
    return SamplingParams(max_tokens=req.max_tokens, logprobs=req.logprobs, extra_args=extra,
                          output_kind=RequestOutputKind.CUMULATIVE, **req.sampling.vllm_kwargs(), **scoring)


def _result(out, p: _Pending, done: float) -> EngineResult:
    outputs = [o for _, o in sorted(p.outputs.items())]  # _step recorded every completion, the last included
    choices = tuple(_completion(o, p.request.logprobs) for o in outputs)
    completion = choices[0]
    injection = InjectionReport.from_params(out.kv_transfer_params)
    first = outputs[0].logprobs
    logprobs = {tok: lp.logprob for tok, lp in first[0].items()} if first else {}
    return EngineResult(
        token_ids=tuple(completion.token_ids),
        text=completion.text,
        ttft_s=(p.first_token or done) - p.submitted,
        latency_s=done - p.submitted,
        prompt_tokens=len(out.prompt_token_ids),
        cached_tokens=out.num_cached_tokens or 0,
        injection=injection,
        first_logprobs=logprobs,
        scored=_scored(out, p.request) if p.request.score_last else (),
        adapter=getattr(out, "lora_request", None) is not None or bool(injection and injection.kv_map),
        choices=choices,
    )


def _completion(o, top_n: int | None) -> Completion:
    """vLLM's CompletionOutput -> ours. Each step's logprobs hold the top-n by rank (1-based) and
    the sampled token, which may rank lower: the alternatives are the top-n only."""
    logprobs = None
    if o.logprobs is not None:
        logprobs = tuple(TokenLogprob(tok, step[tok].logprob, _top(step, top_n or 0))
                         for tok, step in zip(o.token_ids, o.logprobs))
    reason = o.finish_reason if o.finish_reason in ("stop", "length") else "stop"
    return Completion(o.index, o.text, tuple(o.token_ids), reason, logprobs)


def _top(step: dict, n: int) -> tuple[tuple[int, float], ...]:
    best = sorted(step.items(), key=lambda e: e[1].rank)
    return tuple((t, lp.logprob) for t, lp in best if lp.rank <= n)[:n]


def _scored(out, req: EngineRequest) -> tuple[float, ...]:
    """Logprobs of the last n prompt tokens, each under the tokens before it."""
    ids = out.prompt_token_ids[-req.score_last:]
    entries = (out.prompt_logprobs or [])[-req.score_last:]
    if len(entries) != len(ids) or any(e is None or t not in e for e, t in zip(entries, ids)):
        raise EngineError("prompt logprobs missing for the scored tokens (were they served from cache?)")
    return tuple(e[t].logprob for e, t in zip(entries, ids))
