"""The reader's KV map: a fixed per-(layer, KV head) map applied to the injected facts' keys and
values, trained by `kvmem tune-reader` like the LoRA (and instead of it, by default).

Why: a fact encoded on its own attended only to the header and its context, never to the other
facts, so its KV differs from what text prefill computes there (the diagnosis in
docs/benchmarks.md). The map moves it back toward text prefill's, in the KV itself: it runs
once per injected token in the connector, so the reply's tokens cost what they cost without
it (a LoRA runs on every computed token), and the blobs stay as the encoder wrote them.

Keys: per rotary pair i (dims i and i + R/2 of the R rotated dims, RoPE's neox pairing), the
complex multiply
  k'_pair = (a + i b) * k_pair,  i.e.  k' = a * k + b * pair_swap(k)  (a, b tied per pair).
A complex multiply commutes with RoPE's rotation of the pair, at any frequency, so applying it to
keys already rotated to any position is the same as applying it before RoPE: one map serves
every position, and models whose layers rotate with different bases (Gemma 3) alike. Partial
rotary (R < D): the D - R dims RoPE leaves alone are paired the same way among themselves (j and
j + (D - R)/2); nothing rotates them, so any pairing commutes. It can sharpen or flatten
attention per frequency (|a + ib|) and shift it in phase.
Values (no RoPE): v' = value_scale * v + value_shift, per dimension.

File: `kv_map.safetensors` in the adapter folder, float32 tensors key_a, key_b [layers,
kv_heads, head_dim / 2] and value_scale, value_shift [layers, kv_heads, head_dim], all finite;
its metadata names `rotary_dim` R (absent in maps from before: the whole head). Starting at
key_a = value_scale = 1 and the rest 0, it changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvmem.errors import AdapterError

if TYPE_CHECKING:  # torch is imported where tensors are made: adapters.py reads this module without it
    import torch

FILE = "kv_map.safetensors"
NAMES = ("key_a", "key_b", "value_scale", "value_shift")


@dataclass(frozen=True)
class KVMap:
    key_a: torch.Tensor  # [L, H, D/2]
    key_b: torch.Tensor  # [L, H, D/2]
    value_scale: torch.Tensor  # [L, H, D]
    value_shift: torch.Tensor  # [L, H, D]
    rotary_dim: int | None = None  # R, the dims RoPE rotates; None: all D

    @classmethod
    def identity(cls, layers: int, kv_heads: int, head_dim: int, requires_grad: bool = False,
                 rotary_dim: int | None = None) -> "KVMap":
        import torch

        check_rotary_dim(head_dim, rotary_dim)
        half, full = (layers, kv_heads, head_dim // 2), (layers, kv_heads, head_dim)
        return cls(*(t.requires_grad_(requires_grad) for t in
                     (torch.ones(half), torch.zeros(half), torch.ones(full), torch.zeros(full))),
                   rotary_dim=None if rotary_dim == head_dim else rotary_dim)

    @property
    def shape(self) -> tuple[int, int, int]:
        """(layers, kv_heads, head_dim)."""
        return tuple(self.value_scale.shape)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, n) for n in NAMES)

    def to(self, device, dtype=None) -> "KVMap":
        return KVMap(*(t.detach().to(device, dtype) for t in self.tensors()), rotary_dim=self.rotary_dim)

    def key_factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(a, b) spread from pairs to dims: [L, H, D] each."""
        return spread(self.key_a, self.rotary_dim), spread(self.key_b, self.rotary_dim)

    def keys(self, layer: int, k: torch.Tensor) -> torch.Tensor:
        """k [..., H, n, D] (heads before tokens, as in a transformers cache) -> mapped."""
        a, b = (spread(t[layer], self.rotary_dim).unsqueeze(-2) for t in (self.key_a, self.key_b))  # [H, 1, D]
        return a * k + b * pair_swap(k, self.rotary_dim)

    def values(self, layer: int, v: torch.Tensor) -> torch.Tensor:
        """v [..., H, n, D] -> mapped."""
        return self.value_scale[layer].unsqueeze(-2) * v + self.value_shift[layer].unsqueeze(-2)

    def check_shape(self, layers: int, kv_heads: int, head_dim: int) -> None:
        """AdapterError unless the map fits a model with these dimensions."""
        if self.shape != (layers, kv_heads, head_dim):
            raise AdapterError(f"the reader's KV map is for [layers, kv_heads, head_dim] = {list(self.shape)}, "
                               f"the model has [{layers}, {kv_heads}, {head_dim}]")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [..., D]: (x1, x2) -> (-x2, x1), the neox pairing of dims i and i + D/2."""
    import torch

    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def pair_swap(x: torch.Tensor, rotary_dim: int | None = None) -> torch.Tensor:
    """[..., D] -> [..., D]: rotate_half within the R rotated dims and within the rest (module doc)."""
    import torch

    r = rotary_dim or x.shape[-1]
    if r == x.shape[-1]:
        return rotate_half(x)
    return torch.cat((rotate_half(x[..., :r]), rotate_half(x[..., r:])), dim=-1)


def spread(pairs: torch.Tensor, rotary_dim: int | None = None) -> torch.Tensor:
    """Per-pair factors [..., D/2] -> per-dimension [..., D]: the R/2 rotated pairs' factors
    on dims i and i + R/2, then the rest's on j and j + (D - R)/2."""
    import torch

    r = (rotary_dim or 2 * pairs.shape[-1]) // 2
    rotated, rest = pairs[..., :r], pairs[..., r:]
    return torch.cat((rotated, rotated, rest, rest), dim=-1)


def check_rotary_dim(head_dim: int, rotary_dim: int | None) -> None:
    """AdapterError unless the head splits into pairs as the map pairs them: an even head, and
    an even number of rotated dims (so an even rest)."""
    r = head_dim if rotary_dim is None else rotary_dim
    if head_dim % 2 or not 0 < r <= head_dim or r % 2:
        raise AdapterError(f"the reader's KV map pairs key dims: it needs an even head_dim and rotary_dim, "
                           f"got head_dim {head_dim}, rotary_dim {r}")


def apply(layers: list[tuple[torch.Tensor, torch.Tensor]], start: int, end: int,
          kv_map: KVMap) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The lab's memory cache with tokens [start, end) mapped (differentiable in the map).

    layers: per layer (k, v) [1, kv_heads, n, d]."""
    import torch

    out = []
    for i, (k, v) in enumerate(layers):
        k = torch.cat((k[:, :, :start], kv_map.keys(i, k[:, :, start:end]), k[:, :, end:]), dim=2)
        v = torch.cat((v[:, :, :start], kv_map.values(i, v[:, :, start:end]), v[:, :, end:]), dim=2)
        out.append((k, v))
    return out


def save(folder: Path, kv_map: KVMap) -> None:
    """Write the map into an adapter folder (checked first)."""
    from safetensors.torch import save_file

    tensors = {n: t.detach().float().contiguous().clone() for n, t in zip(NAMES, kv_map.tensors())}
    _checked(tensors, str(folder), kv_map.rotary_dim)
    metadata = {} if kv_map.rotary_dim is None else {"rotary_dim": str(kv_map.rotary_dim)}
    save_file(tensors, str(Path(folder) / FILE), metadata=metadata)


def load(folder: Path | str | None) -> KVMap | None:
    """The map of an adapter folder; None when it has none. AdapterError when the file is there
    but unreadable or malformed."""
    if folder is None or not (Path(folder) / FILE).is_file():
        return None
    from safetensors import safe_open

    path = Path(folder) / FILE
    try:
        with safe_open(str(path), framework="pt") as f:
            tensors = {n: f.get_tensor(n) for n in f.keys()}
            rotary_dim = (f.metadata() or {}).get("rotary_dim")
        rotary_dim = None if rotary_dim is None else int(rotary_dim)
    except Exception as e:  # noqa: BLE001 - safetensors raises its own and OS errors
        raise AdapterError(f"{path} is unreadable: {e}") from e
    return _checked({n: t.float() for n, t in tensors.items()}, str(path), rotary_dim)


def _checked(tensors: dict, where: str, rotary_dim: int | None = None) -> KVMap:
    import torch

    if set(tensors) != set(NAMES):
        raise AdapterError(f"{where}: a KV map holds tensors {list(NAMES)}, got {sorted(tensors)}")
    full = tuple(tensors["value_scale"].shape)
    if len(full) != 3 or full[2] % 2 or tuple(tensors["value_shift"].shape) != full \
            or any(tuple(tensors[n].shape) != (*full[:2], full[2] // 2) for n in ("key_a", "key_b")):
        raise AdapterError(f"{where}: a KV map needs key_a, key_b [layers, kv_heads, head_dim / 2] and "
                           f"value_scale, value_shift [layers, kv_heads, head_dim], got "
                           f"{ {n: list(t.shape) for n, t in tensors.items()} }")
    for name, t in tensors.items():
        if not bool(torch.isfinite(t).all()):
            raise AdapterError(f"{where}: {name} must be finite")
    try:
        check_rotary_dim(full[2], rotary_dim)
    except AdapterError as e:
        raise AdapterError(f"{where}: {e}") from None
    return KVMap(*(tensors[n] for n in NAMES), rotary_dim=None if rotary_dim == full[2] else rotary_dim)
