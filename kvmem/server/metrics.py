"""Prometheus metrics: chat TTFT per mode, injected tokens, fallbacks, rejections, and store gauges.

Counters and the histogram are updated per request; the store gauges (encode queue depth, KV
store bytes, facts, tiers, the engine's counters) are read from KVMem.status() when /metrics is
scraped.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    def __init__(self, runtime) -> None:
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram("kvmem_chat_ttft_seconds", "Time to first token of chat completions",
                              ["mode"], buckets=_TTFT_BUCKETS, registry=r)
        self.chats = Counter("kvmem_chat_requests", "Chat completions answered", ["mode", "stream"], registry=r)
        self.injected = Counter("kvmem_injected_tokens", "Prompt tokens injected from stored fact KV", registry=r)
        self.fallbacks = Counter("kvmem_fallbacks", "Facts served as text because their KV was unusable", registry=r)
        self.saved = Counter("kvmem_prefill_tokens_saved", "Prompt tokens injected instead of prefilled, by the "
                             "narrowest scope the chat named (user, agent, run)", ["scope"], registry=r)
        self.fallback_reasons = Counter("kvmem_fallback_facts", "Facts of KV-mode chats prefilled as text, by why",
                                        ["reason"], registry=r)
        self.rejected = Counter("kvmem_rejected_requests", "Requests refused without being served", ["reason"],
                                registry=r)
        Gauge("kvmem_inflight_chats", "Chat requests being answered", registry=r).set_function(
            lambda: runtime.gate.count)
        Gauge("kvmem_engine_ready", "1 once the engine has loaded", registry=r).set_function(
            lambda: float(runtime.mem is not None))
        r.register(_StoreCollector(runtime))

    def observe_chat(self, result, stream: bool, scope: str = "user", trace=None) -> None:
        """One answered chat; `trace` (trace.ChatTrace, when kept) gives each fact's way in."""
        self.ttft.labels(result.mode).observe(result.ttft_s)
        self.chats.labels(result.mode, str(stream).lower()).inc()
        self.injected.inc(result.injected_tokens)
        self.fallbacks.inc(result.fallbacks)
        self.saved.labels(scope).inc(result.injected_tokens)
        for reason, count in (trace.fallbacks if trace is not None else {}).items():
            self.fallback_reasons.labels(reason).inc(count)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StoreCollector:
    """Store gauges read at scrape time, at most once per STORE_TTL_S (a blob folder of 100k
    files costs a stat each): a burst of scrapes reads the store once."""

    STORE_TTL_S = 2.0

    def __init__(self, runtime) -> None:
        self.runtime = runtime
        self._store: tuple[float, object] | None = None  # (when, KVMem.status())

    def describe(self):
        return []  # computed at scrape time; nothing to check at registration

    def collect(self):
        mem = self.runtime.mem
        if mem is None:
            return
        now = time.monotonic()
        if self._store is None or now - self._store[0] > self.STORE_TTL_S:
            self._store = (now, mem.status())
        status = self._store[1]
        yield GaugeMetricFamily("kvmem_encode_queue_depth", "Facts waiting for their KV to be encoded",
                                value=status.encode_queue)
        yield GaugeMetricFamily("kvmem_kv_store_bytes", "Bytes of KV blobs on disk", value=status.kv_bytes)
        yield GaugeMetricFamily("kvmem_facts", "Facts stored (all tenants)", value=status.facts)
        yield from _tier_metrics(status.tiers)
        engine = status.engine
        yield CounterMetricFamily("kvmem_requests_aborted", "Engine requests aborted because their caller went away",
                                  value=engine.aborted if engine else 0)
        yield CounterMetricFamily("kvmem_fact_encodes", "Facts this process sent to the engine to encode, each "
                                  "under its lease (summed over gateways: a fact counted twice was encoded twice)",
                                  value=status.fact_encodes)
        if engine is not None and engine.kind == "remote":  # behind replicas (kvmem gateway)
            family = CounterMetricFamily("kvmem_replica_requests", "Engine requests answered per replica; affinity "
                                         "'first' when it was the user's first choice (rendezvous hashing)",
                                         labels=["replica", "affinity"])
            for url, first, n in engine.answered:
                family.add_metric([url, "first" if first else "other"], n)
            yield family
            routed = GaugeMetricFamily("kvmem_replica_up", "Replicas this gateway routes to now (a static list, or "
                                       "the live members): 1 up, 0 passed over until a probe finds it up",
                                       labels=["replica"])
            for up, urls in ((1, engine.replicas_up), (0, engine.replicas_down)):
                for url in urls:
                    routed.add_metric([url], up)
            yield routed


def _tier_metrics(tiers: dict):
    """The KV tiers: RAM (decoded blobs in the engine process) and disk (blob files)."""
    hits = CounterMetricFamily("kvmem_kv_tier_hits", "Fact blobs found in this tier (disk: facts served from KV; "
                               "ram: blobs the engine did not have to read from disk)", labels=["tier"])
    misses = CounterMetricFamily("kvmem_kv_tier_misses", "Fact blobs not found in this tier (disk: facts served "
                                 "as text; ram: blobs read from disk)", labels=["tier"])
    for tier in ("ram", "disk"):
        hits.add_metric([tier], tiers[f"{tier}_hits"])
        misses.add_metric([tier], tiers[f"{tier}_misses"])
    yield hits
    yield misses
    budget = GaugeMetricFamily("kvmem_kv_tier_budget_bytes", "Byte budget of each KV tier (absent: unlimited)",
                               labels=["tier"])
    budget.add_metric(["ram"], tiers["ram_budget_bytes"])
    if tiers["disk_budget_bytes"] is not None:
        budget.add_metric(["disk"], tiers["disk_budget_bytes"])
    yield budget
    yield GaugeMetricFamily("kvmem_kv_disk_tier_bytes", "Bytes of fact blobs counted against the disk budget",
                            value=tiers["disk_bytes"])
    yield CounterMetricFamily("kvmem_kv_evictions", "Fact blobs evicted by the disk budget or a tenant quota",
                              value=tiers["evictions"])
    yield CounterMetricFamily("kvmem_kv_readmissions", "Evicted facts queued for re-encoding because chats used them",
                              value=tiers["readmissions"])
