"""One fact's KV cache as a self-checking safetensors blob.

Layout "LTHD": key and value are [num_layers, num_tokens, num_kv_heads, head_size].
Keys are stored pre-RoPE (after any per-head k-norm, before rotation), so a blob can be
injected at any position. The header carries what is needed to refuse a blob that does not
belong: format version, model fingerprint, token ids and a checksum over all of it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import torch
import xxhash
from safetensors.torch import save as st_save

from kvmem.config import KV_FORMAT_VERSION
from kvmem.errors import BlobError

LAYOUT = "LTHD"


@dataclass(frozen=True, eq=False)
class KVBlob:
    fact_id: str
    fingerprint: str
    token_ids: tuple[int, ...]
    key: torch.Tensor  # [L, T, H, D], pre-RoPE
    value: torch.Tensor  # [L, T, H, D]
    # Optional extra tensors (debugging, e.g. the rotated keys as the engine cached them).
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.key.dim() != 4 or self.key.shape != self.value.shape:
            raise ValueError(f"key {tuple(self.key.shape)} and value {tuple(self.value.shape)} must both be [L, T, H, D]")
        if self.key.shape[1] != len(self.token_ids):
            raise ValueError(f"{len(self.token_ids)} token ids for {self.key.shape[1]} KV tokens")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.key, self.value, *self.extras.values()))


# xxh3-128 hashes a blob at memory speed: a cold 100-fact request verifies ~70 MB of KV, which
# blake2b (our first checksum, still accepted on read) spent ~90 ms on. Corruption is the
# threat here, not forgery, so a non-cryptographic hash is enough.
CHECKSUM = "xxh3_128"
_HASHES = {"xxh3_128": xxhash.xxh3_128, "blake2b": lambda: hashlib.blake2b(digest_size=16)}


def checksum(fingerprint: str, token_ids: tuple[int, ...], tensors: dict[str, torch.Tensor],
             algo: str = CHECKSUM) -> str:
    parts = []
    for name, t in tensors.items():
        t = t.contiguous()
        parts.append((name, t.dtype, tuple(t.shape), memoryview(t.view(torch.uint8).numpy()) if t.numel() else b""))
    return _digest(fingerprint, token_ids, parts, algo)


def _digest(fingerprint: str, token_ids, parts: list[tuple[str, torch.dtype, tuple, bytes | memoryview]],
            algo: str) -> str:
    """parts: (name, dtype, shape, raw little-endian bytes) per tensor."""
    h = _HASHES[algo]()
    h.update(fingerprint.encode())
    h.update(json.dumps(list(token_ids)).encode())
    for name, dtype, shape, raw in sorted(parts, key=lambda p: p[0]):
        h.update(f"{name}:{dtype}:{shape}".encode())
        h.update(raw)
    return h.hexdigest()


def encode_blob(blob: KVBlob) -> bytes:
    tensors = {"key": blob.key.contiguous(), "value": blob.value.contiguous()}
    tensors.update({f"extra.{k}": v.contiguous() for k, v in blob.extras.items()})
    metadata = {
        "kvmem_format": str(KV_FORMAT_VERSION),
        "layout": LAYOUT,
        "fact_id": blob.fact_id,
        "fingerprint": blob.fingerprint,
        "num_tokens": str(blob.num_tokens),
        "key_dtype": str(blob.key.dtype),
        "value_dtype": str(blob.value.dtype),
        "token_ids": json.dumps(list(blob.token_ids)),
        "checksum_algo": CHECKSUM,
        "checksum": checksum(blob.fingerprint, blob.token_ids, tensors),
    }
    return st_save(tensors, metadata=metadata)


def verify_blob(data: bytes | bytearray, fact_id: str, fingerprint: str) -> tuple[int, ...]:
    """Check a blob file's header and checksum without building tensors; -> its token ids.

    Raises BlobError(CORRUPT) or BlobError(STALE). The scheduler needs only this (no tensors:
    a cold check costs a file read and a hash, not an allocation per blob).
    """
    return _verified(data, fact_id, fingerprint)[0]


def check_header(header: dict, body_size: int, fact_id: str, fingerprint: str) -> None:
    """The cheap check (no checksum): is a blob with this parsed header and data size whole, this
    fact's and this model's? Raises BlobError(CORRUPT | STALE). Finds truncated, empty and
    swapped files at start-up without reading their tensors."""
    meta = header.get("__metadata__") or {}
    if meta.get("kvmem_format") != str(KV_FORMAT_VERSION) or meta.get("layout") != LAYOUT:
        raise BlobError(fact_id, BlobError.STALE, f"format {meta.get('kvmem_format')}/{meta.get('layout')}")
    if meta.get("fact_id") != fact_id:
        raise BlobError(fact_id, BlobError.CORRUPT, f"holds fact {meta.get('fact_id')!r}")
    if meta.get("fingerprint") != fingerprint:
        raise BlobError(fact_id, BlobError.STALE, f"written for model {str(meta.get('fingerprint'))[:12]}")
    try:
        end = max((info["data_offsets"][1] for name, info in header.items() if name != "__metadata__"), default=0)
    except (TypeError, KeyError, IndexError) as e:
        raise BlobError(fact_id, BlobError.CORRUPT, f"bad tensor table: {e}") from None
    if end != body_size:
        raise BlobError(fact_id, BlobError.CORRUPT, f"{body_size} data bytes, the header says {end}")


def _verified(data, fact_id: str, fingerprint: str) -> tuple[tuple[int, ...], list]:
    try:
        header_len = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + header_len])
        meta = header.pop("__metadata__")
        token_ids = tuple(json.loads(meta["token_ids"]))
        body = memoryview(data)[8 + header_len :]
        parts = [(name, _TORCH_DTYPES[info["dtype"]], tuple(info["shape"]), body[slice(*info["data_offsets"])])
                 for name, info in header.items()]
    except Exception as e:  # noqa: BLE001 - any parse failure is corruption
        raise BlobError(fact_id, BlobError.CORRUPT, f"unreadable: {e}") from e
    if meta.get("kvmem_format") != str(KV_FORMAT_VERSION) or meta.get("layout") != LAYOUT:
        raise BlobError(fact_id, BlobError.STALE, f"format {meta.get('kvmem_format')}/{meta.get('layout')}")
    algo = meta.get("checksum_algo", "blake2b")  # blobs written before xxh3 carry no algo
    if algo not in _HASHES:
        raise BlobError(fact_id, BlobError.STALE, f"unknown checksum {algo!r}")
    if _digest(meta.get("fingerprint", ""), token_ids, parts, algo) != meta.get("checksum"):
        raise BlobError(fact_id, BlobError.CORRUPT, "checksum mismatch")
    if meta["fingerprint"] != fingerprint:
        raise BlobError(fact_id, BlobError.STALE, f"written for model {meta['fingerprint'][:12]}")
    if meta.get("fact_id") != fact_id:
        raise BlobError(fact_id, BlobError.CORRUPT, f"holds fact {meta.get('fact_id')!r}")
    return token_ids, parts


def decode_blob(data: bytes | bytearray, fact_id: str, fingerprint: str) -> KVBlob:
    """Parse and verify. Raises BlobError(CORRUPT) or BlobError(STALE); never returns a bad blob.

    The tensors are views into `data` (no copy) when it is a bytearray, as KVStore reads it.
    """
    if not isinstance(data, bytearray):
        data = bytearray(data)  # torch wants a writable buffer to share
    token_ids, parts = _verified(data, fact_id, fingerprint)
    try:
        tensors = {name: _tensor(raw, dtype, shape) for name, dtype, shape, raw in parts}
        extras = {k.removeprefix("extra."): v for k, v in tensors.items() if k.startswith("extra.")}
        return KVBlob(fact_id, fingerprint, token_ids, tensors["key"], tensors["value"], extras)
    except Exception as e:  # noqa: BLE001 - a verified file that still does not parse is corrupt
        raise BlobError(fact_id, BlobError.CORRUPT, str(e)) from e


def _tensor(raw: memoryview, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    if not len(raw):
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(raw, dtype=dtype).view(shape)


_TORCH_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                 "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8}
