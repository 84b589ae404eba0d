"""The on-disk KV store: one blob file per fact, under a folder per model fingerprint.

Writes are atomic (temp file, fsync, rename), so a reader sees a whole blob or none.
Decoded blobs are kept in a per-process LRU (the RAM tier) keyed by the file's identity (inode,
size, mtime), so a hot fact costs one stat() per request, and a rewritten file is never served
stale. `shared()` hands the connector's scheduler and worker halves one store when vLLM runs them
in one process (one GPU, UniProcExecutor): the scheduler's check of a request's blobs (`warm`) then
loads them into the RAM tier, and the forward pass reads them from there, not from disk a second
time. vLLM's CPU backend always runs the worker in a process of its own; there the scheduler only
checks, and the worker's own RAM tier serves repeats.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path

from kvmem.errors import BlobError, InvalidInputError
from kvmem.kv.blob import KVBlob, check_header, decode_blob, encode_blob, verify_blob

_MAX_HEADER = 64 << 20  # safetensors' own bound on a header
_VERIFIED_ENTRIES = 200_000  # token ids of checked blobs: ~1 KB each at most
_FACT_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")


def check_fact_id(fact_id: str) -> str:
    if not isinstance(fact_id, str) or not _FACT_ID.match(fact_id) or fact_id.startswith("."):
        raise InvalidInputError(f"fact id {fact_id!r} must be 1-128 of [A-Za-z0-9_.:-], not starting with '.'")
    return fact_id


class KVStore:
    _shared: dict[tuple, "KVStore"] = {}
    _shared_lock = threading.Lock()

    @classmethod
    def shared(cls, root: Path | str, fingerprint: str, hot_cache_bytes: int = 512 << 20) -> "KVStore":
        """One store per (folder, model, RAM budget) in this process."""
        key = (str(Path(root).resolve()), fingerprint, hot_cache_bytes)
        with cls._shared_lock:
            store = cls._shared.get(key)
            if store is None:
                store = cls._shared[key] = cls(root, fingerprint, hot_cache_bytes)
            return store

    def __init__(self, root: Path | str, fingerprint: str, hot_cache_bytes: int = 512 << 20) -> None:
        self.fingerprint = fingerprint
        self.dir = Path(root) / fingerprint[:16]
        self._hot: OrderedDict[str, tuple[tuple, KVBlob]] = OrderedDict()
        self._hot_bytes = 0
        self._hot_limit = hot_cache_bytes
        self._verified: OrderedDict[str, tuple[tuple, tuple[int, ...]]] = OrderedDict()  # header-only checks
        self._lock = threading.Lock()
        self.worker_attached = False  # a connector worker reads this instance (same process)
        self.ram_hits = 0  # get() served from the RAM tier
        self.disk_loads = 0  # get() that read and decoded the file

    def path(self, fact_id: str) -> Path:
        return self.dir / f"{check_fact_id(fact_id)}.safetensors"

    def put(self, blob: KVBlob) -> Path:
        if blob.fingerprint != self.fingerprint:
            raise BlobError(blob.fact_id, BlobError.STALE, "refusing to store a blob of another model")
        dest = self.path(blob.fact_id)
        self.dir.mkdir(parents=True, exist_ok=True)
        data = encode_blob(blob)
        fd, tmp = tempfile.mkstemp(prefix=f".{blob.fact_id}.", dir=self.dir)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, dest)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return dest

    def get(self, fact_id: str) -> KVBlob:
        """The verified blob, or BlobError(MISSING | CORRUPT | STALE)."""
        return self.fetch(fact_id)[0]

    def fetch(self, fact_id: str) -> tuple[KVBlob, bool]:
        """-> (the verified blob, whether it came from the RAM tier); BlobError as get()."""
        path, stamp = self._stamp(fact_id)
        with self._lock:
            hit = self._hot.get(fact_id)
            if hit is not None and hit[0] == stamp:
                self._hot.move_to_end(fact_id)
                self.ram_hits += 1
                return hit[1], True
        blob = decode_blob(self._read(path, fact_id), fact_id, self.fingerprint)
        self._remember(fact_id, stamp, blob)
        with self._lock:
            self.disk_loads += 1
        return blob, False

    def warm(self, fact_id: str) -> tuple[tuple[int, ...], bool | None]:
        """-> (the blob's verified token ids, whether it was already in RAM), leaving the blob in
        the RAM tier for the load that follows. Only checks (token_ids(); None for "in RAM") when
        there is no RAM tier or no worker in this process to read it (vLLM's CPU backend runs the
        worker apart)."""
        if self._hot_limit <= 0 or not self.worker_attached:
            return self.token_ids(fact_id), None
        blob, in_ram = self.fetch(fact_id)
        return blob.token_ids, in_ram

    def token_ids(self, fact_id: str) -> tuple[int, ...]:
        """A blob's verified token ids without building its tensors (the scheduler's check).

        Raises BlobError(MISSING | CORRUPT | STALE) exactly where get() would.
        """
        path, stamp = self._stamp(fact_id)
        with self._lock:
            for cache in (self._hot, self._verified):
                hit = cache.get(fact_id)
                if hit is not None and hit[0] == stamp:
                    cache.move_to_end(fact_id)
                    return hit[1] if cache is self._verified else hit[1].token_ids
        token_ids = verify_blob(self._read(path, fact_id), fact_id, self.fingerprint)
        with self._lock:
            self._verified[fact_id] = (stamp, token_ids)
            if len(self._verified) > _VERIFIED_ENTRIES:
                self._verified.popitem(last=False)
        return token_ids

    def stamp(self, fact_id: str) -> tuple | None:
        """The blob file's identity (inode, size, mtime), None when there is none: a rewrite
        (atomic rename of a new file) always changes it."""
        try:
            return self._stamp(fact_id)[1]
        except BlobError:
            return None

    def _stamp(self, fact_id: str) -> tuple[Path, tuple]:
        path = self.path(fact_id)
        try:
            st = path.stat()
        except FileNotFoundError:
            raise BlobError(fact_id, BlobError.MISSING) from None
        return path, (st.st_ino, st.st_size, st.st_mtime_ns)

    @staticmethod
    def _read(path: Path, fact_id: str) -> bytearray:
        """The file's bytes in a bytearray, which decoded tensors share instead of copying."""
        try:
            with path.open("rb") as f:
                size = os.fstat(f.fileno()).st_size
                data = bytearray(size)
                if f.readinto(data) != size:
                    raise BlobError(fact_id, BlobError.CORRUPT, "file changed while being read")
                return data
        except FileNotFoundError:
            raise BlobError(fact_id, BlobError.MISSING) from None

    def exists(self, fact_id: str) -> bool:
        return self.path(fact_id).is_file()

    def intact(self, fact_id: str) -> bool:
        """Header-only check (no checksum, tensors not read): the file is whole, this fact's, this
        model's. Cheap enough for every blob at start-up; token_ids() is the full check."""
        try:
            with self.path(fact_id).open("rb") as f:
                size = os.fstat(f.fileno()).st_size
                n = int.from_bytes(f.read(8), "little")
                if size < 8 or n > min(size - 8, _MAX_HEADER):
                    return False
                header = json.loads(f.read(n))
            check_header(header, size - 8 - n, fact_id, self.fingerprint)
            return True
        except (OSError, ValueError, AttributeError, BlobError):
            return False

    def delete(self, fact_id: str) -> bool:
        with self._lock:
            hit = self._hot.pop(fact_id, None)
            if hit is not None:
                self._hot_bytes -= hit[1].nbytes
            self._verified.pop(fact_id, None)
        try:
            self.path(fact_id).unlink()
            return True
        except FileNotFoundError:
            return False

    def total_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.dir.glob("*.safetensors")) if self.dir.is_dir() else 0

    def _remember(self, fact_id: str, stamp: tuple, blob: KVBlob) -> None:
        if blob.nbytes > self._hot_limit:
            return
        with self._lock:
            old = self._hot.pop(fact_id, None)
            if old is not None:
                self._hot_bytes -= old[1].nbytes
            self._hot[fact_id] = (stamp, blob)
            self._hot_bytes += blob.nbytes
            while self._hot_bytes > self._hot_limit:
                _, (_, evicted) = self._hot.popitem(last=False)
                self._hot_bytes -= evicted.nbytes
