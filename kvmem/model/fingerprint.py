"""A model fingerprint: what a KV blob must have been computed with to be injected.

fingerprint = sha256(config.json, weights' sha256, serving dtype, KV format version).
config.json is hashed without what records who wrote the folder rather than the model (the path
it was converted from, the writer's transformers version), keys sorted: one model converted in two
virtualenvs has one fingerprint, so its KV blobs and its shipped reader adapter serve both.
Hashing the weights costs about a second per 250 MB, so the weights' hash is cached in the
folder, keyed by file size and mtime.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from kvmem.config import KV_FORMAT_VERSION

_CACHE_FILE = ".kvmem-weights-sha256.json"
_CHUNK = 1 << 22
_PROVENANCE = ("_name_or_path", "transformers_version")


def fingerprint(model_dir: Path, dtype: str, kv_format: int = KV_FORMAT_VERSION) -> str:
    h = hashlib.sha256()
    h.update(model_config(model_dir))
    h.update(weights_hash(model_dir).encode())
    h.update(f"dtype={dtype};kv_format={kv_format}".encode())
    return h.hexdigest()


def model_config(model_dir: Path) -> bytes:
    """config.json as hashed: provenance keys dropped, keys sorted."""
    config = json.loads((model_dir / "config.json").read_text())
    for key in _PROVENANCE:
        config.pop(key, None)
    return json.dumps(config, sort_keys=True).encode()


def weights_hash(model_dir: Path) -> str:
    files = sorted(model_dir.glob("*.safetensors")) or sorted(model_dir.glob("*.bin"))
    stamp = [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    cache = model_dir / _CACHE_FILE
    try:
        cached = json.loads(cache.read_text())
        if cached["stamp"] == stamp:
            return cached["sha256"]
    except (OSError, ValueError, KeyError):
        pass
    h = hashlib.sha256()
    for f in files:
        with f.open("rb") as fh:
            while chunk := fh.read(_CHUNK):
                h.update(chunk)
    digest = h.hexdigest()
    try:
        cache.write_text(json.dumps({"stamp": stamp, "sha256": digest}))
    except OSError:
        pass  # a read-only model folder just means hashing again next time
    return digest
