"""The KV store: one blob per fact, under a folder per model fingerprint, in up to three tiers.

- RAM: decoded blobs in a per-process LRU (below).
- The local folder: one file per blob.
- Shared (optional, `shared_url`): Redis, for many processes on many hosts (kv/shared.py).

With a shared tier, it is authoritative and each process's folder is a cache of it: put() writes
the shared tier, then the local file, and returns once both hold the blob (so a blob reported
encoded survives the loss of the replica that made it); a read that finds no local file pulls the
blob into the folder first (a failover replica serves blobs it never encoded; a folder that
cannot take it, a full disk, makes the blob MISSING there: served as text). delete() removes
the blob there, which publishes a forget: every store of that tier drops its local file and RAM
entry (a listener thread per store). Messages missed while disconnected are made up for by a
reconcile after each (re)subscription, the first included: local files the shared tier no longer
holds are deleted, so a process that was down during a delete does not keep the deleted KV.
Without a shared tier the folder is all there is, as below.

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
import logging
import os
import re
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path

from kvmem.errors import BlobError
from kvmem.ids import check_fact_id
from kvmem.kv.blob import KVBlob, check_header, decode_blob, encode_blob, verify_blob
from kvmem.kv.lru import ByteLRU
from kvmem.kv.shared import SharedTier, SharedTierError

log = logging.getLogger("kvmem.kv")

_MAX_HEADER = 64 << 20  # safetensors' own bound on a header
_VERIFIED_ENTRIES = 200_000  # token ids of checked blobs: ~1 KB each at most
_FACT_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
_SYNC_WAIT_S = 5.0  # at start-up, how long to wait for the first reconcile with the shared tier


class KVStore:
    _shared: dict[tuple, "KVStore"] = {}
    _shared_lock = threading.Lock()

    @classmethod
    def shared(cls, root: Path | str, fingerprint: str, hot_cache_bytes: int = 512 << 20,
               shared_url: str | None = None) -> "KVStore":
        """One store per (folder, model, RAM budget, shared tier) in this process."""
        key = (str(Path(root).resolve()), fingerprint, hot_cache_bytes, shared_url)
        with cls._shared_lock:
            store = cls._shared.get(key)
            if store is None:
                store = cls._shared[key] = cls(root, fingerprint, hot_cache_bytes, shared_url=shared_url)
            return store

    def __init__(self, root: Path | str, fingerprint: str, hot_cache_bytes: int = 512 << 20,
                 shared_url: str | None = None) -> None:
        self.fingerprint = fingerprint
        self.dir = Path(root) / fingerprint[:16]
        self._hot: ByteLRU[tuple[tuple, KVBlob]] = ByteLRU(hot_cache_bytes)  # fact id -> (stamp, blob)
        self._verified: OrderedDict[str, tuple[tuple, tuple[int, ...]]] = OrderedDict()  # header-only checks
        self._lock = threading.Lock()
        self.worker_attached = False  # a connector worker reads this instance (same process)
        self.ram_hits = 0  # get() served from the RAM tier
        self.disk_loads = 0  # get() that read and decoded the file
        self.shared_pulls = 0  # blobs copied from the shared tier into the local folder
        self._tier: SharedTier | None = None
        self._unsubscribe = None
        # Held while a local copy is installed or forgotten, so a forget that arrives while a blob
        # is being pulled or put cannot be undone by that blob landing after it.
        self._install_lock = threading.Lock()
        if shared_url:
            self._tier = SharedTier(shared_url, fingerprint)
            synced = threading.Event()
            self._unsubscribe = self._tier.subscribe(self._forget, synced)
            synced.wait(_SYNC_WAIT_S)

    def close(self) -> None:
        """Stops listening for forgets (nothing to do without a shared tier)."""
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
            self._tier.close()

    @property
    def hot_limit(self) -> int:
        """The RAM tier's budget in bytes (0: no RAM tier)."""
        return self._hot.limit

    def path(self, fact_id: str) -> Path:
        return self.dir / f"{check_fact_id(fact_id)}.safetensors"

    def put(self, blob: KVBlob) -> Path:
        if blob.fingerprint != self.fingerprint:
            raise BlobError(blob.fact_id, BlobError.STALE, "refusing to store a blob of another model")
        dest = self.path(blob.fact_id)
        data = encode_blob(blob)
        if self._tier is None:
            tmp = self._write_temp(blob.fact_id, data)
            try:
                os.replace(tmp, dest)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        else:
            # The shared tier first: a local file then always has its shared copy, which the
            # reconcile checks, and a failed shared write leaves no local file behind.
            version, _ = self._tier.put(blob.fact_id, data)
            self._install(blob.fact_id, data, version)
        return dest

    def _write_temp(self, fact_id: str, data: bytes | bytearray) -> str:
        """The bytes in a synced temp file next to the blob's, for an atomic rename into place."""
        self.dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{fact_id}.", dir=self.dir)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return tmp

    def _install(self, fact_id: str, data: bytes | bytearray, version: str) -> bool:
        """Writes a local copy of the shared tier's `version` of a blob, unless that version was
        deleted or replaced meanwhile (checked under the lock forgets take). -> whether written."""
        tmp = self._write_temp(fact_id, data)
        try:
            with self._install_lock:
                if self._tier.version(fact_id) != version:
                    return False
                os.replace(tmp, self.path(fact_id))
                return True
        finally:
            Path(tmp).unlink(missing_ok=True)

    def get(self, fact_id: str) -> KVBlob:
        """The verified blob, or BlobError(MISSING | CORRUPT | STALE)."""
        return self.fetch(fact_id)[0]

    def fetch(self, fact_id: str) -> tuple[KVBlob, bool]:
        """-> (the verified blob, whether it came from the RAM tier); BlobError as get()."""
        path, stamp = self._stamp(fact_id)
        with self._lock:
            hit = self._hot.get(fact_id)
            if hit is not None and hit[0] == stamp:
                self._hot.touch(fact_id)
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
        if self._hot.limit <= 0 or not self.worker_attached:
            return self.token_ids(fact_id), None
        blob, in_ram = self.fetch(fact_id)
        return blob.token_ids, in_ram

    def token_ids(self, fact_id: str) -> tuple[int, ...]:
        """A blob's verified token ids without building its tensors (the scheduler's check).

        Raises BlobError(MISSING | CORRUPT | STALE) exactly where get() would.
        """
        path, stamp = self._stamp(fact_id)
        with self._lock:
            hot = self._hot.get(fact_id)
            if hot is not None and hot[0] == stamp:
                self._hot.touch(fact_id)
                return hot[1].token_ids
            checked = self._verified.get(fact_id)
            if checked is not None and checked[0] == stamp:
                self._verified.move_to_end(fact_id)
                return checked[1]
        token_ids = verify_blob(self._read(path, fact_id), fact_id, self.fingerprint)
        with self._lock:
            self._verified[fact_id] = (stamp, token_ids)
            if len(self._verified) > _VERIFIED_ENTRIES:
                self._verified.popitem(last=False)
        return token_ids

    def stamp(self, fact_id: str) -> tuple | None:
        """The blob's identity, None when there is none: a rewrite always changes it. The local
        file's (inode, size, mtime) when there is one, else the shared tier's (version, size),
        read without moving the blob. The two kinds differ for one blob, so compare only stamps
        of one store over time; [1] is the size in both."""
        st = _stat(self.path(fact_id))
        if st is not None:
            return st
        return self._shared_stamp(fact_id) if self._tier is not None else None

    def _shared_stamp(self, fact_id: str) -> tuple[str, int] | None:
        try:
            return self._tier.stamp(fact_id)
        except SharedTierError as e:
            log.warning("%s", e)
            return None

    def _stamp(self, fact_id: str) -> tuple[Path, tuple]:
        """The local file and its stamp; without a local file, the blob is pulled from the
        shared tier first (when there is one)."""
        path = self.path(fact_id)
        st = _stat(path)
        if st is None and self._tier is not None:
            self._pull(fact_id)
            st = _stat(path)
        if st is None:
            raise BlobError(fact_id, BlobError.MISSING)
        return path, st

    def _pull(self, fact_id: str) -> None:
        # A version replaced between our read and our install (another process re-encoding the
        # fact) is refused by _install; the new one is there to read, so read again.
        for _ in range(3):
            got = self._tier.get(fact_id)
            if got is None:
                return
            try:
                installed = self._install(fact_id, *got)
            except OSError as e:
                # A full or failing local disk: the blob is unusable here (served as text), and
                # never an OSError out of vLLM's scheduler, which would end the engine.
                raise BlobError(fact_id, BlobError.MISSING,
                                f"cannot copy it from the shared tier into {self.dir}: {e}") from e
            if installed:
                with self._lock:
                    self.shared_pulls += 1
                return

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
        """In the local folder or the shared tier (SharedTierError when that cannot be asked)."""
        if self.path(fact_id).is_file():
            return True
        return self._tier is not None and self._tier.stamp(fact_id) is not None

    def intact(self, fact_id: str) -> bool:
        """Header-only check (no checksum, tensors not read): the file is whole, this fact's, this
        model's. Cheap enough for every blob at start-up; token_ids() is the full check. A blob
        only in the shared tier counts as intact: its header is checked when it is pulled. When
        the shared tier cannot be asked, SharedTierError: "unknown" must not pass for "broken"."""
        if self._tier is not None and not self.path(fact_id).exists():
            return self._tier.stamp(fact_id) is not None
        try:
            header, body_size = self._header(fact_id)
            check_header(header, body_size, fact_id, self.fingerprint)
            return True
        except (OSError, ValueError, AttributeError, BlobError):
            return False

    def codec(self, fact_id: str) -> str | None:
        """The codec the local blob was written with, from its header (tensors not read); None
        without a local file or with an unreadable header."""
        try:
            header, _ = self._header(fact_id)
            codec = (header.get("__metadata__") or {}).get("codec", "none")
        except (OSError, ValueError, AttributeError):
            return None
        return codec if isinstance(codec, str) else None

    def _header(self, fact_id: str) -> tuple[dict, int]:
        """The local file's parsed safetensors header and the size of the data after it;
        ValueError when the file cannot hold one."""
        with self.path(fact_id).open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            n = int.from_bytes(f.read(8), "little")
            if size < 8 or n > min(size - 8, _MAX_HEADER):
                raise ValueError(f"{fact_id}: no blob header")
            return json.loads(f.read(n)), size - 8 - n

    def delete(self, fact_id: str) -> bool:
        """Removes the blob from every tier; with a shared tier, from every process's folder too
        (SharedTierError, and nothing deleted, when the shared tier cannot be reached)."""
        check_fact_id(fact_id)
        shared = self._tier.delete(fact_id) if self._tier is not None else False
        return self._drop_local(fact_id) or shared

    def _drop_local(self, fact_id: str) -> bool:
        """Forgets this process's copies: the RAM tier's and the local file."""
        path = self.path(fact_id)
        with self._install_lock:
            with self._lock:
                self._hot.pop(fact_id)
                self._verified.pop(fact_id, None)
            try:
                path.unlink()
                return True
            except FileNotFoundError:
                return False

    def _forget(self, fact_id: str | None) -> None:
        """The shared tier's listener: a fact deleted by some process, or None for a resync."""
        if fact_id is None:
            self._reconcile()
        elif _FACT_ID.match(fact_id) and not fact_id.startswith("."):
            self._drop_local(fact_id)

    def _reconcile(self) -> None:
        """Deletes local blob files the shared tier no longer holds (forgets this process missed)."""
        local = [p.name[: -len(".safetensors")] for p in self.dir.glob("*.safetensors")] if self.dir.is_dir() else []
        local = [f for f in local if _FACT_ID.match(f) and not f.startswith(".")]
        gone = [f for f, present in self._tier.present(local).items() if not present]
        for fact_id in gone:
            self._drop_local(fact_id)
        if gone:
            log.info("shared KV tier %s: dropped %d local blobs deleted there", self._tier.url, len(gone))

    def resident(self) -> dict[str, int]:
        """fact id -> bytes of each blob the RAM tier holds now (what a replica publishes)."""
        with self._lock:
            return {fact_id: self._hot.size(fact_id) for fact_id in self._hot.keys()}

    def total_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.dir.glob("*.safetensors")) if self.dir.is_dir() else 0

    def _remember(self, fact_id: str, stamp: tuple, blob: KVBlob) -> None:
        with self._lock:
            self._hot.put(fact_id, (stamp, blob), blob.nbytes)


def _stat(path: Path) -> tuple[int, int, int] | None:
    """A local file's identity (inode, size, mtime), None when there is none."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns
