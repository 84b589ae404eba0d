"""KV codecs: how a blob's keys or values [L, T, H, D] are stored, and how they come back.

A coded tensor is a few named parts, each [L, T, ...] so that a token range is a slice of every
part (injection copies token ranges of many blobs into one staging buffer, then decodes per layer
on the cache's device). Scales are per (layer, token, head): the standard granularity for KV
quantization that keeps slicing by token trivial.

  none  the cache's own dtype, bit for bit (lossless; the default)
  fp8   float8 e4m3 with a float16 scale per (layer, token, head)   ~1.9x smaller than bf16
  int8  symmetric int8, float16 scale per (layer, token, head)      ~1.9x smaller than bf16
  int4  asymmetric 4-bit (scale and minimum per (layer, token, head)), two per byte   ~3.6x smaller
  k8v4  keys as int8, values as int4                                  ~2.5x smaller
  k4v8  keys as int4, values as int8                                  ~2.5x smaller
  int7  each head vector Hadamard-rotated, then asymmetric 7-bit, eight per seven bytes  ~2.1x
  int6  the same at 6 bits, eight per six bytes                       ~2.5x smaller
  int4h the same at 4 bits (int4's layout)                            ~3.6x smaller
  k7v8  keys as int7, values as int8                                  ~2.03x smaller

Rotated codecs (int7, int6, int4h; QuaRot's trick): keys have a few outlier channels, so a per-token
scale set by the largest one leaves the other channels a handful of levels. An orthonormal
Hadamard transform of each head vector spreads every channel over all of them; the range shrinks
to a few standard deviations and the levels go where the mass is. Decoding multiplies by the same
matrix (it is its own inverse), on the cache's device, before the keys are re-rotated (RoPE).

k8v4, k4v8 and k7v8 are blob-level codecs (`role_codecs`) that code keys and values apart.
On the bundled model 4 bits cost about as much agreement in either role, and rotation pays on
keys (outlier channels) but hardly on values, so k7v8 (rotated 7-bit keys, int8 values) is the
lossy choice: 2.03x smaller than the cache, first-token agreement 0.97 with the lossless blobs
(docs/benchmarks.md). The default stays none, the only codec that keeps k=1 exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmem.kv.codec_names import CODECS, check_codec  # noqa: F401 - re-exported: codec.py is their home to callers
_ROLES = {"k8v4": ("int8", "int4"), "k4v8": ("int4", "int8"), "k7v8": ("int7", "int8")}  # blob codec -> (key codec, value codec) where they differ
TENSOR_CODECS = tuple(c for c in CODECS if c not in _ROLES)  # what encode() takes
_FP8_MAX = 448.0  # largest finite float8_e4m3fn
_TINY = 2.0**-24  # smallest float16 subnormal: a scale never rounds to zero
_BITS = {"int4": 4, "int4h": 4, "int6": 6, "int7": 7}  # asymmetric codecs: bits per value
_ROTATED = ("int7", "int6", "int4h")


def role_codecs(codec: str) -> tuple[str, str]:
    """A blob codec -> (the keys' tensor codec, the values')."""
    return _ROLES.get(check_codec(codec), (codec, codec))


def blob_codec(key_codec: str, value_codec: str) -> str:
    """The inverse of role_codecs; ValueError for a pair no blob codec names."""
    if key_codec == value_codec:
        return key_codec
    for codec, roles in _ROLES.items():
        if roles == (key_codec, value_codec):
            return codec
    raise ValueError(f"keys in {key_codec}, values in {value_codec}: no blob codec stores that pair")


@dataclass(frozen=True, eq=False)
class Coded:
    """A tensor [L, T, H, D] in a codec's form: parts keyed by name, each [L, T, ...]."""

    codec: str
    parts: dict[str, torch.Tensor]

    @property
    def shape(self) -> tuple[int, int, int, int]:
        layers, tokens, heads, dim = self.parts["data"].shape
        return layers, tokens, heads, dim * 8 // _BITS.get(self.codec, 8)

    @property
    def dtype(self) -> torch.dtype:
        """The stored dtype of the data part (the decoded dtype for codec none)."""
        return self.parts["data"].dtype

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts.values())

    def tokens(self, start: int, end: int) -> "Coded":
        """Tokens [start, end) of every part (views, no copy)."""
        return Coded(self.codec, {name: t[:, start:end] for name, t in self.parts.items()})

    def decode(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """-> [L, T, H, D] in `dtype` (codec none: the stored tensor itself when dtype matches)."""
        return decode_parts(self.codec, self.parts, dtype)


def encode(t: torch.Tensor, codec: str) -> Coded:
    """t [L, T, H, D] (the cache dtype) -> its coded form (a tensor codec, not k8v4 or k4v8)."""
    if check_codec(codec) in _ROLES:
        raise ValueError(f"{codec} codes keys and values differently: encode each with role_codecs({codec!r})")
    if codec == "none":
        return Coded(codec, {"data": t.contiguous()})
    x = t.float()
    if codec in _BITS:
        return _encode_asymmetric(x, codec)
    top = _FP8_MAX if codec == "fp8" else 127.0
    scale = (x.abs().amax(-1, keepdim=True) / top).clamp_min(_TINY).half()  # [L, T, H, 1]
    y = x / scale.float()
    data = y.to(torch.float8_e4m3fn) if codec == "fp8" else y.round().clamp(-127, 127).to(torch.int8)
    return Coded(codec, {"data": data, "scale": scale})


def decode_parts(codec: str, parts: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    """Parts with any leading shape [..., H, D'] -> the decoded [..., H, D] in `dtype`.

    Runs wherever the parts are (the worker decodes on the cache's device).
    """
    data = parts["data"]
    if codec == "none":
        return data if dtype in (None, data.dtype) else data.to(dtype)
    if codec in _BITS:
        q = _unpack4(data) if _BITS[codec] == 4 else _unpack(data, _BITS[codec])  # [..., H, D]
        out = q.float() * parts["scale"].float() + parts["min"].float()
        if codec in _ROTATED:
            out = out @ hadamard(out.shape[-1], out.device)
    else:
        out = data.float() * parts["scale"].float()
    return out if dtype in (None, torch.float32) else out.to(dtype)


def _encode_asymmetric(x: torch.Tensor, codec: str) -> Coded:
    """x [L, T, H, D] float32 -> levels 0..2^bits-1 with a float16 scale and minimum per (l, t, h)."""
    bits = _BITS[codec]
    group = 2 if bits == 4 else 8  # values packed together
    if x.shape[-1] % group:
        raise ValueError(f"{codec} packs {group} values together: head size {x.shape[-1]} must divide by {group}")
    if codec in _ROTATED:
        x = x @ hadamard(x.shape[-1], x.device)
    top = 2**bits - 1
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    scale = ((hi - lo) / top).clamp_min(_TINY).half()  # [L, T, H, 1]
    lo = lo.half()
    q = ((x - lo.float()) / scale.float()).round().clamp(0, top).to(torch.uint8)  # [L, T, H, D]
    data = q[..., 0::2] | (q[..., 1::2] << 4) if bits == 4 else _pack(q, bits)
    return Coded(codec, {"data": data, "scale": scale, "min": lo})


def _unpack4(data: torch.Tensor) -> torch.Tensor:
    """[..., D/2] uint8 -> [..., D] levels 0..15 (low nibble first)."""
    return torch.stack((data & 0x0F, data >> 4), dim=-1).flatten(-2)


def _pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., D] levels below 2^bits -> [..., D * bits / 8] uint8: each 8 values in `bits` bytes,
    the first value in the lowest bits of a little-endian word."""
    dev = q.device
    values = q.long().unflatten(-1, (-1, 8))  # [..., D/8, 8]
    word = (values << (bits * torch.arange(8, device=dev))).sum(-1, keepdim=True)  # [..., D/8, 1]; <= 56 bits
    return ((word >> (8 * torch.arange(bits, device=dev))) & 0xFF).flatten(-2).to(torch.uint8)


def _unpack(data: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of _pack: [..., D * bits / 8] uint8 -> [..., D] levels."""
    dev = data.device
    word = (data.long().unflatten(-1, (-1, bits)) << (8 * torch.arange(bits, device=dev))).sum(-1, keepdim=True)
    return ((word >> (bits * torch.arange(8, device=dev))) & (2**bits - 1)).flatten(-2)


_HADAMARD: dict[tuple[int, str], torch.Tensor] = {}


def hadamard(size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """An orthonormal, symmetric [size, size] float32 matrix H with H @ H = I.

    Sylvester's Hadamard matrix for a power of two; otherwise block-diagonal copies of the largest
    power-of-two one that divides `size` (80 -> five 16-blocks), which spreads outliers less far.
    """
    key = (size, str(device))
    if key not in _HADAMARD:
        block = size & -size  # the largest power of two dividing size
        h = torch.ones(1, 1)
        while h.shape[0] < block:
            h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
        h = torch.block_diag(*[h / block**0.5] * (size // block))
        _HADAMARD[key] = h.to(device)
    return _HADAMARD[key]


def bytes_per_token(codec: str, layers: int, heads: int, head_size: int, itemsize: int) -> int:
    """Stored bytes of one token's K and V under `codec` (itemsize: the cache dtype's)."""
    per_head = {"none": head_size * itemsize, "fp8": head_size + 2, "int8": head_size + 2,
                **{c: head_size * bits // 8 + 4 for c, bits in _BITS.items()}}
    return layers * heads * sum(per_head[c] for c in role_codecs(codec))
