"""One step's injection gathered in the host staging buffer (`Staged`), and the bookkeeping
that maps a step's load jobs onto it: prompt positions and cache slots per token, where each
key was encoded, which tokens go through the reader's KV map.

Runs in vLLM's worker process (worker_side.py builds a `Staged` per injecting step); plain
tensor code, no vLLM imports.
"""

from __future__ import annotations

import torch

from kvmem.connector.paged import slot_mapping
from kvmem.connector.plan import LoadJob, SaveJob
from kvmem.kv.blob import KVBlob
from kvmem.kv.codec import Coded, decode_parts, role_codecs


class Staged:
    """One step's injection in the host staging buffer: coded parts [L, N, ...] per role."""

    def __init__(self, codec: str, slots: torch.Tensor, key: dict, value: dict, src: torch.Tensor,
                 dst: torch.Tensor, mapped: torch.Tensor | None = None, token_ids: torch.Tensor | None = None) -> None:
        self.key_codec, self.value_codec = role_codecs(codec)
        self.slots = slots  # [N] cache slots
        self.key = key  # part name -> [L, N, ...]
        self.value = value
        self.src = src  # [N] position each key was cached at when encoded (-1: stored pre-RoPE)
        self.dst = dst  # [N] serving position
        self.mapped = mapped  # [N] bool: tokens that go through the reader's KV map; None when none does
        self.token_ids = token_ids  # [N] the blobs' tokens (what a recompute embeds)


def encoded_positions(spans: list, blobs: list[KVBlob]) -> torch.Tensor:
    """[N] the position each staged token's key was rotated to when encoded, spans one after
    another (-1 for a blob stored pre-RoPE)."""
    lengths = torch.tensor([s.length for s in spans])
    firsts = torch.tensor([-1 if b.key_position is None else b.key_position + s.src for s, b in zip(spans, blobs)])
    first = torch.repeat_interleave(firsts, lengths)  # [N]
    offset = torch.arange(len(first)) - torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)
    return torch.where(first >= 0, first + offset, -1)


def decode_layer(codec: str, parts: dict[str, torch.Tensor], layer: int, device: torch.device) -> torch.Tensor:
    """Layer `layer` of staged parts [L, N, ...] -> decoded [N, H, D] on `device` (the staging
    buffer itself where nothing is to decode and the device is the host)."""
    on_device = {name: t[layer].to(device, non_blocking=True) for name, t in parts.items()}
    return decode_parts(codec, on_device)


def stacked_shape(part: torch.Tensor, n: int) -> tuple[int, ...]:
    """A part [L, T, ...] of one blob -> the staging shape [L, n, ...] for n tokens."""
    return (part.shape[0], n, *part.shape[2:])


def common_dtype(blobs: list[KVBlob], role: str, name: str) -> torch.dtype:
    """One staging dtype for a part across blobs (format-1 float32 keys beside cache-dtype ones)."""
    dtype = getattr(blobs[0], role).parts[name].dtype
    for blob in blobs[1:]:
        other = getattr(blob, role).parts[name].dtype
        if other != dtype:
            dtype = torch.promote_types(dtype, other)
    return dtype


def decoded(blob: KVBlob) -> KVBlob:
    """The same blob with codec none (float32, the common ground of every codec)."""
    if blob.codec == "none":
        return blob
    return KVBlob(blob.fact_id, blob.fingerprint, blob.token_ids, Coded("none", {"data": blob.keys.decode()}),
                  Coded("none", {"data": blob.values.decode()}), blob.key_position)


def token_map(jobs: list[LoadJob] | list[SaveJob], block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The jobs' spans, one after another -> prompt positions [N] and cache slots [N] (host int64)."""
    positions, slots = [], []
    for job in jobs:
        p = torch.cat([torch.arange(s.start, s.end) for s in job.spans])
        positions.append(p)
        slots.append(slot_mapping(job.block_ids, p, block_size))
    return torch.cat(positions), torch.cat(slots)


def mapped_tokens(jobs: list[LoadJob], positions: torch.Tensor, premapped: list[bool]) -> torch.Tensor | None:
    """[N] bool over the jobs' tokens (as token_map orders them): at or after their job's
    map_from, and not from a span whose blob was mapped already (`premapped`, per span). None
    when no token is."""
    never = positions.max().item() + 1 if len(positions) else 0
    bounds = torch.cat([torch.full((sum(s.length for s in job.spans),),
                                   never if job.map_from is None else job.map_from) for job in jobs])
    lengths = torch.tensor([s.length for job in jobs for s in job.spans])
    mapped = (positions >= bounds) & ~torch.repeat_interleave(torch.tensor(premapped, dtype=torch.bool), lengths)
    return mapped if bool(mapped.any()) else None


def blocks_of(jobs: list[LoadJob], block_size: int) -> set[int]:
    blocks = set()
    for job in jobs:
        for s in job.spans:
            blocks.update(job.block_ids[s.start // block_size : (s.end - 1) // block_size + 1])
    return blocks
