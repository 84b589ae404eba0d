"""`RemoteEngine`: the engine interface of llm.Engine, served by a kvmem replica over HTTP.

A replica is vLLM's stock OpenAI server with kvmem's connector (replica.py). The service then
runs no vLLM itself: it retrieves, assembles the segment-tokenized prompt, and sends the token
ids, the plan (`kv_transfer_params`) and the cache salt to the replica's /v1/completions. The
replica's worker reads and writes blobs in the KV folder it was started with, which this process
must see too (the same folder on one host); encodes resolve once their blobs are there, as they
do in process.

What the HTTP API cannot carry: streamed responses have no `kv_transfer_params`, so a streamed
chat reports no injection accounting; scoring (prompt logprobs over cached tokens) needs the
in-process engine; and a response gives no first-token time unless it is streamed, so `run`
reports the whole latency as TTFT. Chats read without the reader adapter.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterator

import httpx

from kvmem.engine.llm import BLOB_WAIT_S, EngineRequest, EngineResult
from kvmem.engine.plan import ENCODE, KEY
from kvmem.engine.replica import served_name
from kvmem.errors import EngineError, RequestCancelled
from kvmem.kv.store import KVStore
from kvmem.model import ModelInfo

log = logging.getLogger(__name__)

BLOB_POLL_S = 0.005


class RemoteEngine:
    def __init__(self, url: str, model: ModelInfo, kv_dir, *, timeout_s: float = 600.0, workers: int = 32) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self.name = served_name(model)
        self.reader_adapter = None
        self.aborted = 0
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s)
        self._blobs = KVStore(kv_dir, model.fingerprint, hot_cache_bytes=0)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="kvmem-remote")
        self._check_model()

    def _check_model(self) -> None:
        try:
            served = [m["id"] for m in self._http.get("/v1/models").raise_for_status().json()["data"]]
        except (httpx.HTTPError, KeyError, ValueError) as e:
            raise EngineError(f"no kvmem replica answers at {self.url}: {e}") from e
        if self.name not in served:
            raise EngineError(f"the replica at {self.url} serves {served}, not {self.name}: it runs other "
                              f"weights (or was not started with `kvmem replica`), whose KV would not fit ours")

    def submit(self, request: EngineRequest, on_text: Callable[[str], None] | None = None) -> Future:
        """Send one request; the future resolves to its EngineResult (on_text is not called)."""
        return self._pool.submit(self._complete, request)

    def run(self, requests: list[EngineRequest], cancel: threading.Event | None = None) -> list[EngineResult]:
        """Send all requests at once (the replica batches them) and wait for all of them."""
        futures = [self.submit(r) for r in requests]
        if cancel is not None:
            while not all(f.done() for f in futures):
                if cancel.wait(0.05):
                    self.cancel(futures)
                    raise RequestCancelled("cancelled before the replica answered")
        return [f.result() for f in futures]

    def cancel(self, futures: list[Future]) -> None:
        for f in futures:
            f.cancel()  # a request already sent runs to its end on the replica

    def stream(self, request: EngineRequest, cancel: threading.Event | None = None) -> Iterator[str | EngineResult]:
        """Text deltas as the replica sends them, then the EngineResult (without connector accounting)."""
        start = time.perf_counter()
        first, text, ids = None, [], []
        body = self._body(request) | {"stream": True, "stream_options": {"include_usage": True}}
        usage = {}
        with self._http.stream("POST", "/v1/completions", json=body) as response:
            _raise_for(response, read=True)
            for line in response.iter_lines():
                if cancel is not None and cancel.is_set():
                    raise RequestCancelled("the stream was cancelled before it finished")
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices", []):
                    first = first or time.perf_counter()
                    ids += _token_ids(choice)
                    if choice.get("text"):
                        text.append(choice["text"])
                        yield choice["text"]
        done = time.perf_counter()
        yield EngineResult(tuple(ids), "".join(text), (first or done) - start, done - start,
                           usage.get("prompt_tokens", len(request.token_ids)), _cached(usage))

    def _complete(self, request: EngineRequest) -> EngineResult:
        stamps = {s.fact_id: self._blobs.stamp(s.fact_id) for s in request.plan.segments} \
            if request.plan and request.plan.op == ENCODE else {}
        start = time.perf_counter()
        try:
            response = self._http.post("/v1/completions", json=self._body(request))
        except httpx.HTTPError as e:
            raise EngineError(f"replica {self.url} failed: {e}") from e
        _raise_for(response)
        done = time.perf_counter()
        body = response.json()
        choice = body["choices"][0]
        top = ((choice.get("logprobs") or {}).get("top_logprobs") or [None])[0] or {}
        usage = body.get("usage") or {}
        self._await_blobs(stamps, done)
        return EngineResult(
            token_ids=tuple(_token_ids(choice)), text=choice.get("text", ""), ttft_s=done - start,
            latency_s=done - start, prompt_tokens=usage.get("prompt_tokens", len(request.token_ids)),
            cached_tokens=_cached(usage), connector=(body.get("kv_transfer_params") or {}).get(KEY, {}),
            first_logprobs={_id(t): lp for t, lp in top.items()} if request.logprobs else {},
        )

    def _body(self, request: EngineRequest) -> dict:
        if request.score_last:
            raise EngineError("scoring needs prompt logprobs over cached tokens: use the in-process engine")
        body = {"model": self.name, "prompt": list(request.token_ids), "max_tokens": request.max_tokens,
                "temperature": 0.0, "cache_salt": request.salt, "logprobs": request.logprobs or 0}
        if request.plan is not None:
            body["kv_transfer_params"] = request.plan.to_params()
        return body

    def _await_blobs(self, stamps: dict, done: float) -> None:
        """An encode's blobs are written by the replica's worker just after it answers."""
        while stamps and time.perf_counter() < done + BLOB_WAIT_S:
            if all(self._blobs.stamp(f) not in (None, before) for f, before in stamps.items()):
                return
            time.sleep(BLOB_POLL_S)

    def reset_prefix_cache(self) -> bool:
        """vLLM serves /reset_prefix_cache only in its dev mode (VLLM_SERVER_DEV_MODE=1)."""
        try:
            return self._http.post("/reset_prefix_cache").status_code == 200
        except httpx.HTTPError:
            return False

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._http.close()


def _raise_for(response: httpx.Response, read: bool = False) -> None:
    if response.status_code >= 400:
        if read:
            response.read()
        raise EngineError(f"replica answered {response.status_code}: {response.text[:500]}")


def _token_ids(choice: dict) -> list[int]:
    """Sampled token ids: the replica returns tokens as "token_id:<n>" (--return-tokens-as-token-ids)."""
    return [_id(t) for t in (choice.get("logprobs") or {}).get("tokens") or []]


def _id(token: str) -> int:
    return int(token.removeprefix("token_id:"))


def _cached(usage: dict) -> int:
    return ((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
