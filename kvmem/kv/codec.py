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

k8v4 and k4v8 are blob-level codecs (`role_codecs`) that spend the bits on one role (KIVI
reports keys as the sensitive one). On the bundled model, with these per-token scales, 4 bits
cost about as much agreement in either role (docs/benchmarks.md): int8 stays the lossy choice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmem.errors import InvalidInputError

CODECS = ("none", "fp8", "int8", "int4", "k8v4", "k4v8")
_ROLES = {"k8v4": ("int8", "int4"), "k4v8": ("int4", "int8")}  # blob codec -> (key codec, value codec) where they differ
TENSOR_CODECS = tuple(c for c in CODECS if c not in _ROLES)  # what encode() takes
_FP8_MAX = 448.0  # largest finite float8_e4m3fn
_TINY = 2.0**-24  # smallest float16 subnormal: a scale never rounds to zero


def check_codec(name: str) -> str:
    if name not in CODECS:
        raise InvalidInputError(f"unknown KV codec {name!r}; choose one of {', '.join(CODECS)}")
    return name


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
        return layers, tokens, heads, dim * 2 if self.codec == "int4" else dim

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
    if codec == "int4":
        if x.shape[-1] % 2:
            raise ValueError(f"int4 packs two values per byte: head size {x.shape[-1]} must be even")
        lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
        scale = ((hi - lo) / 15).clamp_min(_TINY).half()  # [L, T, H, 1]
        lo = lo.half()
        q = ((x - lo.float()) / scale.float()).round().clamp(0, 15).to(torch.uint8)  # [L, T, H, D]
        return Coded(codec, {"data": q[..., 0::2] | (q[..., 1::2] << 4), "scale": scale, "min": lo})
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
    if codec == "int4":
        low, high = data & 0x0F, data >> 4
        q = torch.stack((low, high), dim=-1).flatten(-2)  # [..., H, D]
        out = q.float() * parts["scale"].float() + parts["min"].float()
    else:
        out = data.float() * parts["scale"].float()
    return out if dtype in (None, torch.float32) else out.to(dtype)


def bytes_per_token(codec: str, layers: int, heads: int, head_size: int, itemsize: int) -> int:
    """Stored bytes of one token's K and V under `codec` (itemsize: the cache dtype's)."""
    per_head = {"none": head_size * itemsize, "fp8": head_size + 2, "int8": head_size + 2,
                "int4": head_size // 2 + 4}
    return layers * heads * sum(per_head[c] for c in role_codecs(codec))
