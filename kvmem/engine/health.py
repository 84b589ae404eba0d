"""Which replicas a gateway passes over, learned two ways.

Passively: a request that finds a replica refusing connections, dropping them or answering
502/503 marks it down for DOWN_S seconds (remote.py). Actively: a daemon thread asks every
replica for its model list every `probe_s` seconds. A replica that does not answer, or no longer
serves our weights (a redeploy with another model behind the same address), is marked down
before a user's request has to find out; one that answers is marked up at once, without waiting
out DOWN_S. Routing only reorders: a replica marked down is still tried last, so a wrong mark
costs a detour, never a failed request.

A replica that accepts connections and then says nothing (a hung process, a stalled network)
fails no request by itself: the requests sent to it just wait. Once SILENT_AFTER probes in a row
got no answer at all (connect or read error, or no answer within PROBE_TIMEOUT_S), the replica is
`silent`, and the gateway gives up the requests still waiting on it (remote.py) and sends them to
the next replica. An answer that is merely slow (a long prompt's prefill, a long reply) never
counts: the probe asks for the model list, which the replica's API answers without its engine.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import httpx

log = logging.getLogger(__name__)

DOWN_S = 10.0  # how long a replica that failed a request is passed over
PROBE_S = 2.0  # between two probes of every replica
PROBE_TIMEOUT_S = 2.0  # a replica slower than this to list its models counts as down
SILENT_AFTER = 2  # probes in a row with no answer at all before requests waiting on it are given up


def served_models(http: httpx.Client, url: str) -> list[str]:
    """The model ids a replica serves (vLLM's /v1/models); httpx or parsing errors as raised."""
    return [m["id"] for m in http.get(f"{url}/v1/models").raise_for_status().json()["data"]]


class Health:
    def __init__(self, urls: list[str], serves: Callable[[list[str]], bool], probe_s: float | None = PROBE_S,
                 scrape: Callable[[httpx.Client, str], None] | None = None) -> None:
        """serves(model ids) -> whether a replica listing those ids serves our weights.
        probe_s: None starts no probe thread (requests alone then mark replicas down).
        scrape(http, url): called after each probe that found `url` healthy (its errors are
        logged, never counted against the replica)."""
        self.urls = urls
        self._serves = serves
        self._scrape = scrape
        self._down: dict[str, float] = {}  # url -> until when it is passed over
        self._unanswered: dict[str, int] = {}  # url -> probes in a row that got no answer at all
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        if probe_s is not None:
            self._thread = threading.Thread(target=self._loop, args=(probe_s,), name="kvmem-replica-probe",
                                            daemon=True)
            self._thread.start()

    def mark_down(self, url: str, for_s: float | None = None) -> None:
        """Pass `url` over for `for_s` seconds (default DOWN_S)."""
        until = time.monotonic() + (DOWN_S if for_s is None else for_s)
        with self._lock:
            self._down[url] = max(self._down.get(url, 0.0), until)

    def mark_up(self, url: str) -> None:
        with self._lock:
            self._down.pop(url, None)

    def is_down(self, url: str) -> bool:
        with self._lock:
            return self._down.get(url, 0.0) > time.monotonic()

    def silent(self, url: str) -> bool:
        """The last SILENT_AFTER probes got no answer from `url` (not even an error status)."""
        with self._lock:
            return self._unanswered.get(url, 0) >= SILENT_AFTER

    def order(self, preferred: list[str]) -> list[str]:
        """`preferred` with the replicas marked down moved to the end (each part keeps its order)."""
        down = {u for u in preferred if self.is_down(u)}
        return [u for u in preferred if u not in down] + [u for u in preferred if u in down]

    def probe(self, http: httpx.Client) -> dict[str, bool]:
        """Ask every replica once; -> url: healthy."""
        result = {}
        for url in self.urls:
            answered = True
            try:
                result[url] = self._serves(served_models(http, url))
            except httpx.TransportError:
                result[url], answered = False, False
            except (httpx.HTTPError, KeyError, TypeError, ValueError):
                result[url] = False
            with self._lock:
                self._unanswered[url] = 0 if answered else self._unanswered.get(url, 0) + 1
            was_down = self.is_down(url)
            if result[url]:
                self.mark_up(url)
            else:
                self.mark_down(url, for_s=float("inf"))  # until a probe finds it healthy again
            if was_down != (not result[url]):
                log.warning("replica %s is %s", url, "up" if result[url] else "down (probe)")
            if result[url] and self._scrape is not None:
                try:
                    self._scrape(http, url)
                except (httpx.HTTPError, ValueError, IndexError) as e:
                    log.debug("replica %s: scrape failed (%s)", url, e)
        return result

    def _loop(self, probe_s: float) -> None:
        with httpx.Client(timeout=PROBE_TIMEOUT_S) as http:
            while not self._stop.wait(probe_s):
                self.probe(http)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=PROBE_TIMEOUT_S * len(self.urls) + 1)
