"""Which reader adapter serves a model: found by the model's fingerprint, like blobs.

`reader_adapter` setting (KVConfig.reader_adapter, KVMEM_READER_ADAPTER):
  "auto" - the one `kvmem tune-reader` wrote for this model under <home>/adapters/, else the one
           shipped in the package for it (the bundled model has one), else none;
  "off"  - never;
  a path - that folder, if it was trained for this model.
An adapter made for another model is refused with a log line: the chat is served in plain KV mode.
So is one whose KV map does not fit the model's rotary embeddings or shape, which only vLLM's
worker can tell: it drops the map at start-up, and the engine then refuses the adapter (llm.py).
"""

from __future__ import annotations

import logging
from pathlib import Path

from kvmem.errors import AdapterError
from kvmem.reader import kvmap
from kvmem.reader.lora import folder_targets, has_lora, read_meta

log = logging.getLogger(__name__)

SHIPPED = Path(__file__).parent / "shipped"


def identity(folder: Path) -> str:
    """A short digest of an adapter's weights (LoRA and KV map): two adapters for one model differ
    here. A LoRA-only adapter keeps the digest it had before KV maps existed."""
    import hashlib

    digest = hashlib.sha256()
    for name in ("adapter_model.safetensors", kvmap.FILE):
        path = Path(folder) / name
        if not path.exists():
            continue
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:12]


def folder_name(fingerprint: str) -> str:
    return fingerprint[:16]


def user_folder(home: Path, fingerprint: str) -> Path:
    return Path(home) / "adapters" / folder_name(fingerprint)


def find(setting: str, home: Path, fingerprint: str) -> Path | None:
    """The adapter folder to serve `fingerprint` with, or None (plain KV mode)."""
    if setting == "off":
        return None
    if setting == "auto":
        candidates = [user_folder(home, fingerprint), SHIPPED / folder_name(fingerprint)]
        existing = [c for c in candidates if c.exists()]
        if not existing:
            log.info("no reader adapter for model %s: KV mode without one", fingerprint[:12])
            return None
        return _checked(existing[0], fingerprint)
    return _checked(Path(setting), fingerprint)


def _checked(folder: Path, fingerprint: str) -> Path | None:
    try:
        meta = read_meta(folder)
        if has_lora(folder):
            folder_targets(folder)
        kvmap.load(folder)  # a malformed KV map refuses the whole adapter
    except AdapterError as e:
        log.warning("reader adapter refused, plain KV mode: %s", e)
        return None
    if meta.get("fingerprint") != fingerprint:
        log.warning("reader adapter %s refused, plain KV mode: trained for model %s, this model is %s",
                    folder, str(meta.get("fingerprint"))[:12], fingerprint[:12])
        return None
    log.info("reader adapter for KV-mode chats: %s", folder)
    return folder
