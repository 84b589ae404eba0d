"""Asynchronous copies between host and device: a side stream, events, a reusable pinned buffer,
and the host copy that gathers a step's blob tokens into it (`concat_tokens`).

On a CUDA device, injection and encoding copies run on a side stream so that the engine's own
stream (the forward pass) only waits where it must: per layer, on an event. On any other device
(vLLM's CPU backend) the same calls run synchronously and events are None, so the worker side
has one code path.
"""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np
import torch

_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class SideStream:
    """A CUDA side stream for one device, or a synchronous stand-in elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_async = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self.is_async else None

    def __enter__(self) -> "SideStream":
        """Run the block's work on the side stream, after everything already queued on the
        engine's stream (so reads see the forward's writes and writes land after earlier reads)."""
        if self.is_async:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            self._ctx = torch.cuda.stream(self._stream)
        else:
            self._ctx = nullcontext()
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._ctx.__exit__(*exc)

    def record(self) -> "torch.cuda.Event | None":
        """An event marking the work queued on the side stream so far (None when synchronous)."""
        if not self.is_async:
            return None
        event = torch.cuda.Event()
        event.record(self._stream)
        return event

    def make_engine_wait(self, event: "torch.cuda.Event | None") -> None:
        """The engine's stream waits (on the device, not the host) until `event` has passed."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)


def synchronize(event: "torch.cuda.Event | None") -> None:
    """Block the calling host thread until `event` has passed (no-op for synchronous work)."""
    if event is not None:
        event.synchronize()


class HostStaging:
    """One host buffer reused across steps; pinned where copies can be asynchronous.

    `take` returns a view of the buffer shaped as asked, growing it (to the next power of two)
    when too small. Before the caller refills it, the copies that read the previous contents must
    have finished: `take` waits for the event given to `release` by the last user.
    """

    def __init__(self, pin: bool) -> None:
        self._pin = pin
        self._buffer = torch.empty(0, dtype=torch.uint8)
        self._busy: "torch.cuda.Event | None" = None

    def take(self, shapes: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
        """Views of the buffer, one per (shape, dtype), laid out one after another (64-byte aligned)."""
        synchronize(self._busy)
        self._busy = None
        sizes = [_aligned(_numel(shape) * _itemsize(dtype)) for shape, dtype in shapes]
        total = sum(sizes)
        if total > self._buffer.numel():
            self._buffer = torch.empty(_next_pow2(total), dtype=torch.uint8, pin_memory=self._pin)
        views, at = [], 0
        for (shape, dtype), size in zip(shapes, sizes):
            n = _numel(shape) * _itemsize(dtype)
            views.append(self._buffer[at : at + n].view(dtype).view(shape))
            at += size
        return views

    def release(self, event: "torch.cuda.Event | None") -> None:
        """The buffer's contents are in use until `event` has passed."""
        self._busy = event

    @property
    def nbytes(self) -> int:
        return self._buffer.numel()


def concat_tokens(parts: list[torch.Tensor], out: torch.Tensor) -> None:
    """Host tensors [L, T_i, ...] side by side along dim 1 into `out` [L, sum T_i, ...]: bit for
    bit what torch.cat(parts, dim=1, out=out) writes.

    Where every part has out's dtype, numpy copies their bits as integers of that size. Inside
    vLLM's CPU worker that took about half of torch.cat's time: 101 blobs' K and V at k=100
    (46 MB) took ~8.5 ms against ~16 ms, though both take ~3 ms in a process of their own
    (docs/benchmarks.md, "Staging by numpy"). Parts of another dtype (a format-1 float32 key
    beside bf16 ones) are converted as torch.cat converts them."""
    if (not parts or sum(p.shape[1] for p in parts) != out.shape[1]
            or any(p.shape[0] != out.shape[0] or p.shape[2:] != out.shape[2:] for p in parts)):
        raise ValueError(f"staging: {len(parts)} parts of {[tuple(p.shape) for p in parts[:3]]}... do not fill "
                         f"{tuple(out.shape)}")
    same = _SAME_SIZE_INT.get(out.element_size())
    if (same is None or out.device.type != "cpu"
            or any(p.dtype != out.dtype or p.device.type != "cpu" for p in parts)):
        torch.cat(parts, dim=1, out=out)
        return
    np.concatenate([p.view(same).numpy() for p in parts], axis=1, out=out.view(same).numpy())


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _aligned(n: int) -> int:
    return -(-n // 64) * 64


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()
