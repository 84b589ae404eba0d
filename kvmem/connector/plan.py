"""What a request asks of the connector, as carried in `kv_transfer_params["kvmem"]`.

A request either INJECTS segments (load their blobs into its leading prompt tokens) or ENCODES
them (save the KV the engine computed for those prompt spans). Segments are token spans of the
prompt: `start` is where the segment's tokens sit in this request's prompt.

The rest of the file is the connector's own wire format: what the scheduler side sends the
worker side each step.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

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

    def read_with_reader(self, reading: bool) -> "Plan":
        """This plan as sent for a request that does (or does not) read with the reader adapter:
        without it, nothing is mapped."""
        return self if reading or self.map_from is None else replace(self, map_from=None)

    def to_params(self) -> dict[str, Any]:
        body = {"op": self.op, "segments": [[s.fact_id, s.start, s.length] for s in self.segments]}
        if self.map_from is not None:
            body["map_from"] = self.map_from
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
        return cls(op, tuple(sorted(segments, key=lambda s: s.start)), map_from)


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
