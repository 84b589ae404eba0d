"""`RemoteEngine`: the engine interface of llm.Engine, served by kvmem replicas over HTTP.

A replica is vLLM's stock OpenAI server with kvmem's connector (replica.py). The service then
runs no vLLM itself: it retrieves, assembles the segment-tokenized prompt, and sends the token
ids, the plan (`kv_transfer_params`) and the cache salt to a replica's /v1/completions. The
replica's worker reads and writes blobs in the KV folder it was started with, and in the shared
Redis tier when one is configured (kv/shared.py); this process must see the same blobs through
its `blobs` store (the same folder on one host, or the same shared tier), since encodes resolve
once their blobs are there, as they do in process.

The replicas are a fixed list, or the live members of the membership table in PostgreSQL
(membership.py: replicas register themselves, gateways follow the table, `set_replicas`).
With several replicas, each user's requests go to one of them, chosen by rendezvous hashing of
the user id (so that replica's prefix cache and RAM tier stay warm for them, and adding or
losing a replica moves only the users it had); with residency routing (`residency`, a
ResidencyView: engine/residency.py) a KV-mode chat goes where most of its facts' KV already is
in RAM, unless that replica's queue costs more than the pulls it saves. A replica that refuses connections or answers
502/503 is passed over for a while and the request goes to the user's next choice; a probe of
every replica every few seconds marks replicas down and up between requests (health.py). With
none left the request fails with EngineError (HTTP 503 at the server).

Deadlines (Timeouts): a connection not made within `connect_s`, a reply not finished within
`reply_s` (a non-streamed reply arrives whole, after the last token: this bounds the longest
generation, not the wait for a first byte), and a replica the probes find silent (watched.py:
requests waiting on it are given up within a few seconds) all count as that replica failing: it
is passed over and the request goes to the next replica, as long as nothing of it reached the
caller (a stream that already sent text fails instead). A slow replica is never given up for
being slow: a long prompt's prefill or a long reply only has to finish within `reply_s`.

What the HTTP API cannot carry: streamed responses have no `kv_transfer_params`, so a streamed
chat reports no injection accounting; scoring (prompt logprobs over cached tokens) needs the
in-process engine; and a response gives no first-token time unless it is streamed, so `run`
reports the whole latency as TTFT. KV-mode chats read with the reader adapter when the replica
serves it (`kvmem replica` loads the one found for the model) and `use_reader` allows it.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator

import httpx

from kvmem.engine import watched
from kvmem.engine.completions import Streamed, cached_tokens, completion, token_id
from kvmem.engine.membership import Registry, Watcher
from kvmem.engine.residency import ResidencyView
from kvmem.engine.health import PROBE_S, Health, served_models
from kvmem.connector.plan import ENCODE, INJECT, InjectionReport
from kvmem.engine.protocol import BLOB_WAIT_S, ChoiceDelta, EngineRequest, EngineResult, EngineStatus
from kvmem.engine.replica import reader_name, served_name
from kvmem.errors import EngineError, InvalidInputError, RequestCancelled
from kvmem.kv.store import KVStore
from kvmem.model import ModelInfo

log = logging.getLogger(__name__)

BLOB_POLL_S = 0.005
_RETRY_STATUS = (502, 503)


@dataclass(frozen=True)
class Timeouts:
    """Per attempt on one replica. connect_s: to open a connection (nothing was sent: always safe
    to try the next replica). reply_s: the longest a replica may stay silent on a connection, so a
    whole non-streamed reply (sent after its last token) or any gap in a stream; a replica that
    hangs is found sooner by the probes (health.SILENT_AFTER)."""

    connect_s: float = 5.0
    reply_s: float = 600.0

    def httpx(self) -> httpx.Timeout:
        return httpx.Timeout(self.reply_s, connect=self.connect_s)


def _normalized(urls: str | list[str]) -> list[str]:
    """Base URLs from a comma-separated string or a list, without blanks or trailing slashes."""
    return [u.strip().rstrip("/") for u in (urls.split(",") if isinstance(urls, str) else urls) if u.strip()]


def rendezvous(key: str, urls: list[str]) -> list[str]:
    """`urls` in `key`'s order of preference (highest random weight first)."""
    return sorted(urls, key=lambda u: hashlib.blake2b(f"{key}\0{u}".encode(), digest_size=8).digest(), reverse=True)


class RemoteEngine:
    def __init__(self, urls: str | list[str], model: ModelInfo, blobs: KVStore, *, use_reader: bool = True,
                 timeouts: Timeouts = Timeouts(), workers: int = 32, probe_s: float | None = PROBE_S,
                 members: Registry | None = None, residency: ResidencyView | None = None) -> None:
        """urls: one replica's base URL, several in a list or comma-separated. blobs: the store the
        replicas write to, as this process sees it (only stamps are read: encodes wait for them).
        use_reader: False (reader_adapter "off") keeps KV-mode chats on the plain model even where
        a replica has one. probe_s: seconds between health probes of the replicas (None: none).
        members: the membership table (membership.py) to follow instead of a fixed `urls` list:
        replicas that register serve our weights are routed to, those that drain or lapse no more.
        residency: route KV-mode chats by where their facts' KV is resident (None: rendezvous)."""
        self.urls = _normalized(urls)
        if not self.urls and members is None:
            raise EngineError("no replica URL given")
        self.model = model
        self.name = served_name(model)
        self.reader_adapter: str | None = None  # the replica's LoRA module name, once seen there
        self._use_reader = use_reader
        self.aborted = 0
        self.failovers = 0  # requests sent to a user's second (or later) choice
        # (replica, whether it is the user's first choice by rendezvous) -> requests it answered:
        # the affinity hit rate, and the load per replica.
        self.answered: Counter[tuple[str, bool]] = Counter()
        self._http = httpx.Client(timeout=timeouts.httpx(), transport=watched.transport(self._silent))
        self._blobs = blobs
        self.residency = residency
        self._fact_bytes_per_token = model.kv_bytes_per_token() if residency is not None else 0
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="kvmem-remote")
        down = self._check_models() if members is None else []
        # Probed from now on, the weights being checked; those down at start are passed over.
        self.replicas = Health(self.urls, lambda ids: self.name in ids, probe_s=probe_s,
                               scrape=self._scrape_queue if residency is not None else None)
        for url in down:
            self.replicas.mark_down(url)
        # With a membership table the live set arrives now (Watcher calls set_replicas at once) and on every change.
        self._watcher = Watcher(members, model.fingerprint, self.set_replicas) if members is not None else None

    def set_replicas(self, urls: list[str]) -> None:
        """Route to these replicas from now on (the membership Watcher's thread calls it). New
        ones are asked for their models first: one serving other weights is left out, one not
        answering yet is kept but passed over until a probe finds it up. Requests already sent
        keep their replica (a drained one finishes them)."""
        urls = _normalized(urls)
        for url in (u for u in list(urls) if u not in self.urls):
            served, error = self._ask(url)
            if error is not None:
                log.warning("new replica %s does not answer yet (%s): passed over until it does", url, error)
                self.replicas.mark_down(url)
            elif self.name not in served:
                log.error("replica %s registered for our weights but serves %s: left out", url, served)
                urls.remove(url)
        if self.residency is not None:
            for gone in set(self.urls) - set(urls):
                self.residency.forget(gone)
        # One assignment each: routing and probing threads read whole lists, never a list being changed.
        self.urls = urls
        self.replicas.urls = urls

    def _silent(self, host: str, port: int) -> bool:
        """watched.py's question for a waiting read: has the replica at host:port gone silent?"""
        replicas = getattr(self, "replicas", None)  # None while the first model check runs
        return replicas is not None and any(replicas.silent(u) for u in self.urls if _origin(u) == (host, port))

    def _check_models(self) -> list[str]:
        """At least one replica must answer, and every one that does must serve our weights;
        -> those that did not answer."""
        errors, down = [], []
        for url in self.urls:
            served, error = self._ask(url)
            if error is not None:
                errors.append(f"{url}: {error}")
                down.append(url)
            elif self.name not in served:
                raise EngineError(f"the replica at {url} serves {served}, not {self.name}: it runs other weights "
                                  f"(or was not started with `kvmem replica`), whose KV would not fit ours")
        if len(errors) == len(self.urls):
            raise EngineError(f"no kvmem replica answers: {'; '.join(errors)}")
        for error in errors:
            log.warning("replica down at start: %s", error)
        return down

    def _ask(self, url: str) -> tuple[list[str], Exception | None]:
        """The model ids the replica at `url` serves, noting its reader adapter where it serves
        ours; ([], the error) when it does not answer."""
        try:
            served = served_models(self._http, url)
        except (httpx.HTTPError, KeyError, ValueError) as e:
            return [], e
        if self.name in served and self._use_reader and reader_name(self.model) in served:
            self.reader_adapter = reader_name(self.model)
        return served, None

    def route(self, key: str, facts: dict[str, int] | None = None) -> list[str]:
        """Replicas to try for this user, best first; those marked down go last. `facts` (fact id
        -> blob bytes, a KV-mode chat's) reorder the live ones by residency where it is on."""
        order = self.replicas.order(rendezvous(key, self.urls))
        if self.residency is None or not facts:
            return order
        live = [u for u in order if not self.replicas.is_down(u)]
        return self.residency.order(live, facts) + order[len(live):]

    def _facts(self, request: EngineRequest) -> dict[str, int] | None:
        """The blob bytes an injecting request needs, per fact (None: it injects nothing)."""
        if self.residency is None or request.plan is None or request.plan.op != INJECT:
            return None
        return {s.fact_id: s.length * self._fact_bytes_per_token for s in request.plan.segments}

    def _scrape_queue(self, http: httpx.Client, url: str) -> None:
        """The health probe, per healthy replica: its running + waiting requests (vLLM's gauges)."""
        text = http.get(f"{url}/metrics").text
        queued = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                     if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")))
        self.residency.queued(url, int(queued))

    def _busy(self, url: str, delta: int) -> None:
        """This gateway's requests in flight at `url` (residency routing weighs them as load)."""
        if self.residency is not None:
            (self.residency.sent if delta > 0 else self.residency.done)(url)

    def _send(self, request: EngineRequest, body: dict, stream: bool = False,
              tried: list[str] | None = None) -> tuple[str, httpx.Response]:
        """POST to the user's replicas in turn until one answers; -> (url, response). `tried`:
        replicas that already failed this request (skipped; those that fail here are added)."""
        tried = [] if tried is None else tried
        errors = []
        for i, url in enumerate(self.route(request.route, self._facts(request))):
            if url in tried:
                continue
            self._busy(url, +1)
            try:
                if stream:
                    response = self._http.send(self._http.build_request("POST", f"{url}/v1/completions", json=body),
                                               stream=True)
                else:
                    response = self._http.post(f"{url}/v1/completions", json=body)
            except httpx.TransportError as e:  # refused, dropped, timed out or silent: nothing reached the caller
                self._busy(url, -1)
                errors.append(f"{url}: {e!r}")
            else:
                if not stream or response.status_code in _RETRY_STATUS:
                    self._busy(url, -1)  # an accepted stream is busy until stream() closes it
                if response.status_code not in _RETRY_STATUS:
                    self.failovers += i > 0
                    self.answered[url, url == rendezvous(request.route, self.urls)[0]] += 1
                    return url, response
                errors.append(f"{url}: HTTP {response.status_code}")
                response.close()
            self._failed(url, errors[-1], tried)
        raise EngineError(f"no replica answered: {'; '.join(errors) or 'every replica failed this request'}")

    def _failed(self, url: str, error: str, tried: list[str]) -> None:
        tried.append(url)
        self.replicas.mark_down(url)
        log.warning("replica %s failed (%s); trying the next one", url, error)

    def encode(self, requests: list[EngineRequest]) -> None:
        """Run ENCODE requests; run() already waits for their blobs to appear."""
        self.run(requests)

    def health(self) -> bool:
        """At least one replica is not marked down."""
        return any(not self.replicas.is_down(u) for u in self.urls)

    def status(self) -> EngineStatus:
        down = tuple(u for u in self.urls if self.replicas.is_down(u))
        answered = tuple((url, first, n) for (url, first), n in sorted(self.answered.items()))
        return EngineStatus("remote", len(down) < len(self.urls), self.reader_adapter, self.aborted,
                            replicas_up=tuple(u for u in self.urls if u not in down), replicas_down=down,
                            failovers=self.failovers, answered=answered)

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

    def stream(self, request: EngineRequest,
               cancel: threading.Event | None = None) -> Iterator[str | ChoiceDelta | EngineResult]:
        """Text deltas as the replica sends them (str; ChoiceDelta when n > 1), then the
        EngineResult (without connector accounting)."""
        start = time.perf_counter()
        body = self._body(request) | {"stream": True, "stream_options": {"include_usage": True}}
        tried: list[str] = []
        while True:
            url, response = self._send(request, body, stream=True, tried=tried)
            got = Streamed()
            try:
                _raise_for(response, request, read=True)
                for index, text in got.deltas(response, cancel):
                    yield text if request.sampling.n == 1 else ChoiceDelta(index, text)
                break
            except httpx.TransportError as e:
                if got.text:  # the caller has part of the answer: too late to send it elsewhere
                    raise EngineError(f"the replica failed while streaming: {e!r}") from e
                self._failed(url, f"{e!r} before its first token", tried)
            except httpx.HTTPError as e:
                raise EngineError(f"the replica failed while streaming: {e!r}") from e
            finally:
                response.close()
                self._busy(url, -1)
        done = time.perf_counter()
        choices = got.completions(request.logprobs)
        yield EngineResult(choices[0].token_ids, choices[0].text, (got.first or done) - start, done - start,
                           got.usage.get("prompt_tokens", len(request.token_ids)), cached_tokens(got.usage),
                           adapter=bool(request.reader and self.reader_adapter), choices=choices)

    def _complete(self, request: EngineRequest) -> EngineResult:
        stamps = {s.fact_id: self._blobs.stamp(s.fact_id) for s in request.plan.segments} \
            if request.plan and request.plan.op == ENCODE else {}
        start = time.perf_counter()
        _, response = self._send(request, self._body(request))
        _raise_for(response, request)
        done = time.perf_counter()
        body = response.json()
        choices = tuple(completion(c, request.logprobs) for c in sorted(body["choices"], key=lambda c: c["index"]))
        top = ((body["choices"][0].get("logprobs") or {}).get("top_logprobs") or [None])[0] or {}
        usage = body.get("usage") or {}
        injection = InjectionReport.from_params(body.get("kv_transfer_params"))
        self._await_blobs(stamps, done)
        return EngineResult(
            token_ids=choices[0].token_ids, text=choices[0].text, ttft_s=done - start,
            latency_s=done - start, prompt_tokens=usage.get("prompt_tokens", len(request.token_ids)),
            cached_tokens=cached_tokens(usage), injection=injection,
            first_logprobs={token_id(t): lp for t, lp in top.items()} if request.logprobs else {},
            adapter=bool(request.reader and self.reader_adapter) or bool(injection and injection.kv_map),
            choices=choices,
        )

    def _body(self, request: EngineRequest) -> dict:
        if request.score_last:
            raise EngineError("scoring needs prompt logprobs over cached tokens: use the in-process engine")
        # Reading with the reader: the replica's LoRA module where it serves one, and its KV map
        # (applied by its connector to the facts, where its adapter has one) in a salt of its own.
        reading = bool(request.reader and self._use_reader)
        model = self.reader_adapter if reading and self.reader_adapter else self.name
        body = {"model": model, "prompt": list(request.token_ids), "max_tokens": request.max_tokens,
                "cache_salt": request.salt + (":reader" if reading else ""), "logprobs": request.logprobs or 0,
                **request.sampling.completions_fields()}
        if request.plan is not None:
            body["kv_transfer_params"] = request.plan.read_with_reader(reading).to_params()
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
            return all(self._http.post(f"{u}/reset_prefix_cache").status_code == 200 for u in self.urls)
        except httpx.HTTPError:
            return False

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.close()
        self.replicas.close()
        if self.residency is not None:
            self.residency.close()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._http.close()


def _origin(url: str) -> tuple[str, int]:
    u = httpx.URL(url)
    return u.host, u.port or (443 if u.scheme == "https" else 80)


def _raise_for(response: httpx.Response, request: EngineRequest, read: bool = False) -> None:
    if response.status_code >= 400:
        if read:
            response.read()
        if response.status_code == 400 and request.sampling.structured:  # a schema it cannot compile
            raise InvalidInputError(f"the JSON schema cannot be used: {response.text[:500]}", param=request.sampling.schema_from)
        raise EngineError(f"replica answered {response.status_code}: {response.text[:500]}")
