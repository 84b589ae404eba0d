"""The wire between kvmem's clients and its connector inside vLLM: plain Python, no vLLM.

Three things cross it, each a typed value with `to_params`/`from_params`:
- `Plan`: what a request asks of the connector, in `kv_transfer_params["kvmem"]`. A request
  either INJECTS segments (load their blobs into its leading prompt tokens) or ENCODES them
  (save the KV the engine computed for those prompt spans). Segments are token spans of the
  prompt: `start` is where the segment's tokens sit in this request's prompt.
- `InjectionReport`: the connector's answer, in the finished request's `kv_transfer_params`.
- `ConnectorSettings`: how the connector is configured, in vLLM's `kv_connector_extra_config`
  (the same for the in-process engine and for a replica's `vllm serve` command line).

The rest of the file is the connector's own per-step format: what the scheduler side sends the
worker side each step.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

from kvmem.kv.recompute import Recompute

KEY = "kvmem"
INJECT = "inject"
ENCODE = "encode"


@dataclass(frozen=True)
class Segment:
    fact_id: str
    start: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass(frozen=True)
class Plan:
    op: str
    segments: tuple[Segment, ...]
    # Injected tokens at prompt positions >= map_from go through the reader's KV map
    # (reader/kvmap.py: the facts, not the header before them); None: none does.
    map_from: int | None = None
    # Fact tokens recomputed over the injected cache (kv/recompute.py); None: plain injection.
    # Every segment after the first (the prompt's head) is a fact.
    recompute: Recompute | None = None

    def read_with_reader(self, reading: bool) -> "Plan":
        """This plan as sent for a request that does (or does not) read with the reader adapter:
        without it, nothing is mapped."""
        return self if reading or self.map_from is None else replace(self, map_from=None)

    def to_params(self) -> dict[str, Any]:
        body = {"op": self.op, "segments": [[s.fact_id, s.start, s.length] for s in self.segments]}
        if self.map_from is not None:
            body["map_from"] = self.map_from
        if self.recompute is not None and self.recompute.on:
            body["recompute"] = self.recompute.to_params()
        return {KEY: body}

    @classmethod
    def from_params(cls, params: dict[str, Any] | None) -> "Plan | None":
        """None when the request carries no kvmem plan; ValueError when it carries a broken one."""
        body = (params or {}).get(KEY)
        if body is None:
            return None
        op = body.get("op")
        if op not in (INJECT, ENCODE):
            raise ValueError(f"unknown kvmem op {op!r}")
        segments = tuple(Segment(str(f), int(s), int(n)) for f, s, n in body.get("segments", []))
        if any(s.start < 0 or s.length <= 0 for s in segments):
            raise ValueError("segments need start >= 0 and length > 0")
        map_from = body.get("map_from")
        if map_from is not None and (not isinstance(map_from, int) or isinstance(map_from, bool) or map_from < 0):
            raise ValueError(f"map_from must be None or an int >= 0, got {map_from!r}")
        recompute = body.get("recompute")
        recompute = None if recompute is None else Recompute.from_params(recompute)
        return cls(op, tuple(sorted(segments, key=lambda s: s.start)), map_from, recompute)



@dataclass(frozen=True)
class InjectionReport:
    """What the connector did for one inject request (scheduler side, at request_finished)."""

    claimed_tokens: int = 0  # prompt tokens the connector supplied from blobs
    local_hit_tokens: int = 0  # of those, already in vLLM's own prefix cache
    inject_end: int = 0  # the injected prefix ends here (prompt position)
    injected_segments: int = 0  # segments injected, the prompt's head included when injected
    facts_as_text: int = 0  # segments prefilled as text because a blob could not serve them
    ram_hits: int = 0  # this request's blobs already in the RAM tier
    disk_loads: int = 0  # this request's blobs read from disk into the RAM tier
    fallbacks: Mapping[str, str] = field(default_factory=dict)  # fact id -> why its blob was unusable
    kv_map: bool = False  # the injected facts went through the reader's KV map
    recomputed_tokens: int = 0  # fact tokens recomputed over the injected cache (kv/recompute.py)
    held_for_copies: int = 0  # encodes whose blocks still wait for the worker's copy
    ram_tier_hits: int = 0  # every worker's RAM-tier hits since the engine started
    ram_tier_loads: int = 0  # every worker's disk loads into the RAM tier since it started
    # Milliseconds per connector stage for this request (connector/profile.py); the worker's
    # stages only when the request outlived its first step.
    profile_ms: Mapping[str, float] = field(default_factory=dict)

    @property
    def facts_from_blobs(self) -> int:
        """Facts injected from blobs: the first injected segment is the prompt's head."""
        return max(0, self.injected_segments - 1)

    def to_params(self) -> dict[str, Any]:
        return {KEY: {
            "claimed_tokens": self.claimed_tokens, "local_hit_tokens": self.local_hit_tokens,
            "inject_end": self.inject_end, "injected_facts": self.injected_segments,
            "facts_as_text": self.facts_as_text, "ram_hits": self.ram_hits, "disk_loads": self.disk_loads,
            "fallbacks": dict(self.fallbacks), "kv_map": self.kv_map,
            "recomputed_tokens": self.recomputed_tokens, "held_for_copies": self.held_for_copies,
            "tier_totals": {"ram_hits": self.ram_tier_hits, "disk_loads": self.ram_tier_loads},
            "profile_ms": dict(self.profile_ms),
        }}

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> "InjectionReport | None":
        """None when the output carries no kvmem report (text mode, encodes, a streamed answer)."""
        body = (params or {}).get(KEY)
        if not body:
            return None
        totals = body.get("tier_totals") or {}
        return cls(
            claimed_tokens=int(body.get("claimed_tokens", 0)), local_hit_tokens=int(body.get("local_hit_tokens", 0)),
            inject_end=int(body.get("inject_end", 0)), injected_segments=int(body.get("injected_facts", 0)),
            facts_as_text=int(body.get("facts_as_text", 0)), ram_hits=int(body.get("ram_hits", 0)),
            disk_loads=int(body.get("disk_loads", 0)), fallbacks=dict(body.get("fallbacks") or {}),
            kv_map=bool(body.get("kv_map", False)), recomputed_tokens=int(body.get("recomputed_tokens", 0)),
            held_for_copies=int(body.get("held_for_copies", 0)),
            ram_tier_hits=int(totals.get("ram_hits", 0)), ram_tier_loads=int(totals.get("disk_loads", 0)),
            profile_ms={str(k): float(v) for k, v in (body.get("profile_ms") or {}).items()},
        )


@dataclass(frozen=True)
class ConnectorSettings:
    """The connector's configuration, as vLLM hands it over (`kv_connector_extra_config`).
    The defaults are stated here only: the reading side does not restate them."""

    kv_dir: str  # the blob folder (and where start-up refusals are left for the client to read)
    fingerprint: str  # the model's: blobs of other weights are refused as stale
    codec: str = "none"  # how new blobs are stored (kv/codec.py)
    hot_cache_mib: int = 512  # the RAM tier of decoded blobs, per process
    shared_url: str | None = None  # the shared Redis tier (kv/shared.py); None: the local folder only
    # The served reader adapter's folder, whose KV map the worker applies to the facts of chats
    # that ask for it, where the map fits the model; None: none.
    reader_adapter: str | None = None
    is_neox_style: bool = True  # only used when the model's own rotary embedding is not found
    # The URL gateways route to this replica by: with shared_url, the replica publishes what its
    # RAM tier holds under it (connector/residency.py) for residency routing. None: nothing published.
    replica_url: str | None = None

    def to_params(self) -> dict[str, Any]:
        return {"kv_dir": self.kv_dir, "fingerprint": self.fingerprint, "codec": self.codec,
                "hot_cache_mib": self.hot_cache_mib, "shared_url": self.shared_url,
                "reader_adapter": self.reader_adapter, "is_neox_style": self.is_neox_style,
                "replica_url": self.replica_url}

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> "ConnectorSettings":
        """ValueError naming the field when one is missing or of the wrong type; absent or null
        optional fields take the defaults above."""
        params = dict(params or {})
        for name in ("kv_dir", "fingerprint"):
            if not isinstance(params.get(name), (str, Path)) or not str(params[name]):
                raise ValueError(f"kv_connector_extra_config.{name} is required, got {params.get(name)!r}")
        given = {k: v for k, v in params.items() if k in cls.__dataclass_fields__ and v is not None}
        settings = cls(**{**given, "kv_dir": str(params["kv_dir"])})
        if not isinstance(settings.hot_cache_mib, int) or isinstance(settings.hot_cache_mib, bool) \
                or settings.hot_cache_mib < 0:
            raise ValueError(f"kv_connector_extra_config.hot_cache_mib must be an int >= 0, got {settings.hot_cache_mib!r}")
        return settings


# -- scheduler -> worker, once per engine step (pickled across processes) -----------------------
#
# Compact on purpose: a request's block ids and token ranges, never one slot per token. The worker
# expands ranges into slots (slot = block_ids[p // block_size] * block_size + p % block_size).


@dataclass(frozen=True)
class Span(Segment):
    """A segment's tokens from blob offset `src`: blob tokens [src, src + length) at prompt
    positions [start, end)."""

    src: int = 0


@dataclass(frozen=True)
class LoadJob:
    """Write these spans of blobs into a request's blocks (injection)."""

    req_id: str
    block_ids: tuple[int, ...]  # the request's blocks in prompt order, up to the last span's end
    spans: tuple[Span, ...]
    map_from: int | None = None  # prompt positions from here on go through the reader's KV map (Plan)
    recompute: Recompute | None = None  # the plan's: its fact spans' chosen tokens are recomputed


@dataclass(frozen=True)
class SaveJob:
    """Read these prompt spans out of a request's blocks into new blobs (encoding)."""

    req_id: str
    block_ids: tuple[int, ...]
    spans: tuple[Span, ...]  # src 0: a blob holds the whole span
    token_ids: tuple[tuple[int, ...], ...]  # per span: the tokens its blob is for


@dataclass
class ConnectorMeta:
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    built_at: float = 0.0  # the scheduler's time.monotonic() when built (the worker's `handoff`)
