"""One fact's KV cache as a self-checking safetensors blob.

Layout "LTHD": key and value are [num_layers, num_tokens, num_kv_heads, head_size].

Format 2 (written now) keeps the keys exactly as the engine cached them: rotated to the
positions they were encoded at (`key_position` + t) and in the cache's dtype, so a blob is as
large as the engine's own cache for those tokens (less with a lossy codec, kv/codec.py).
Injection rotates a key by the move from its encoded to its serving position, and copies it
untouched when it does not move: a fact served where it was encoded is bit-exact.
Format 1 (read only) stored pre-RoPE float32 keys; such a blob loads with key_position None.

The header carries what is needed to refuse a blob that does not belong: format version, model
fingerprint, token ids and a checksum over all of it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch
import xxhash
from safetensors.torch import save as st_save

from kvmem.errors import BlobError
from kvmem.kv.codec import CODECS, Coded, blob_codec, role_codecs

LAYOUT = "LTHD"
FORMAT = 2  # keys as cached, with their encoded position; any codec
_READABLE = ("1", "2")


@dataclass(frozen=True, eq=False)
class KVBlob:
    """One fact's KV. `keys` and `values` may be given as plain tensors (codec none)."""

    fact_id: str
    fingerprint: str
    token_ids: tuple[int, ...]
    keys: Coded  # [L, T, H, D]: rotated to key_position + t as the engine cached them
    values: Coded  # [L, T, H, D]
    key_position: int | None = 0  # None: format-1 keys, stored pre-RoPE
    digest: str | None = None  # the verified checksum of the file it was read from; None: built in memory

    def __post_init__(self) -> None:
        for name in ("keys", "values"):
            if isinstance(getattr(self, name), torch.Tensor):
                object.__setattr__(self, name, Coded("none", {"data": getattr(self, name)}))
        if len(self.keys.shape) != 4 or self.keys.shape != self.values.shape:
            raise ValueError(f"keys {self.keys.shape} and values {self.values.shape} must both be [L, T, H, D]")
        if self.keys.shape[1] != len(self.token_ids):
            raise ValueError(f"{len(self.token_ids)} token ids for {self.keys.shape[1]} KV tokens")
        if self.key_position is not None and self.key_position < 0:
            raise ValueError(f"key_position {self.key_position} must be >= 0")

    @property
    def key(self) -> torch.Tensor:
        """The keys decoded [L, T, H, D] (codec none: the stored tensor, no copy)."""
        return self.keys.decode()

    @property
    def value(self) -> torch.Tensor:
        return self.values.decode()

    @property
    def codec(self) -> str:
        return blob_codec(self.keys.codec, self.values.codec)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


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
    if blob.key_position is None:
        raise ValueError("format-1 blobs (pre-RoPE keys) are read, never written")
    blob_codec(blob.keys.codec, blob.values.codec)  # ValueError for a pair no codec names
    tensors = {f"{role}.{name}": t.contiguous() for role, coded in (("key", blob.keys), ("value", blob.values))
               for name, t in coded.parts.items()}
    metadata = {
        "kvmem_format": str(FORMAT),
        "layout": LAYOUT,
        "fact_id": blob.fact_id,
        "fingerprint": blob.fingerprint,
        "num_tokens": str(blob.num_tokens),
        "codec": blob.codec,
        "key_position": str(blob.key_position),
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
    _check_format(meta, fact_id)
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


def _verified(data, fact_id: str, fingerprint: str) -> tuple[tuple[int, ...], list, dict]:
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
    _check_format(meta, fact_id)
    algo = meta.get("checksum_algo", "blake2b")  # blobs written before xxh3 carry no algo
    if algo not in _HASHES:
        raise BlobError(fact_id, BlobError.STALE, f"unknown checksum {algo!r}")
    if _digest(meta.get("fingerprint", ""), token_ids, parts, algo) != meta.get("checksum"):
        raise BlobError(fact_id, BlobError.CORRUPT, "checksum mismatch")
    if meta["fingerprint"] != fingerprint:
        raise BlobError(fact_id, BlobError.STALE, f"written for model {meta['fingerprint'][:12]}")
    if meta.get("fact_id") != fact_id:
        raise BlobError(fact_id, BlobError.CORRUPT, f"holds fact {meta.get('fact_id')!r}")
    return token_ids, parts, meta


def _check_format(meta: dict, fact_id: str) -> None:
    if meta.get("kvmem_format") not in _READABLE or meta.get("layout") != LAYOUT:
        raise BlobError(fact_id, BlobError.STALE, f"format {meta.get('kvmem_format')}/{meta.get('layout')}")
    if meta.get("codec", "none") not in CODECS:
        raise BlobError(fact_id, BlobError.STALE, f"unknown codec {meta.get('codec')!r}")


def decode_blob(data: bytes | bytearray, fact_id: str, fingerprint: str) -> KVBlob:
    """Parse and verify. Raises BlobError(CORRUPT) or BlobError(STALE); never returns a bad blob.

    The tensors are views into `data` (no copy) when it is a bytearray, as KVStore reads it.
    """
    if not isinstance(data, bytearray):
        data = bytearray(data)  # torch wants a writable buffer to share
    token_ids, parts, meta = _verified(data, fact_id, fingerprint)
    try:
        tensors = {name: _tensor(raw, dtype, shape) for name, dtype, shape, raw in parts}
        if meta["kvmem_format"] == "1":  # pre-RoPE float32 keys, cache-dtype values
            return KVBlob(fact_id, fingerprint, token_ids, tensors["key"], tensors["value"], None, meta["checksum"])
        roles = dict(zip(("key", "value"), role_codecs(meta.get("codec", "none"))))
        coded = {role: Coded(codec, {name.removeprefix(role + "."): t for name, t in tensors.items()
                                     if name.startswith(role + ".")}) for role, codec in roles.items()}
        return KVBlob(fact_id, fingerprint, token_ids, coded["key"], coded["value"], int(meta["key_position"]),
                      meta["checksum"])
    except Exception as e:  # noqa: BLE001 - a verified file that still does not parse is corrupt
        raise BlobError(fact_id, BlobError.CORRUPT, str(e)) from e


def _tensor(raw: memoryview, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    if not len(raw):
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(raw, dtype=dtype).view(shape)


_TORCH_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                 "F8_E4M3": torch.float8_e4m3fn, "I64": torch.int64, "I32": torch.int32, "I8": torch.int8,
                 "U8": torch.uint8}
