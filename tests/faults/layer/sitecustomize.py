"""The fault tests' file and clock layer, loaded into every Python process of a kvmem server that
the tests start (this folder goes first on its PYTHONPATH, so the interpreter imports this module
at start-up, vLLM's engine and worker processes included). Nothing here runs elsewhere.

Disk full (FAULTS_ENOSPC_ROOTS: folders, os.pathsep-separated; FAULTS_ENOSPC_FLAG: a file): while
the flag file exists, a file opened for writing under one of the folders refuses every write with
OSError(ENOSPC, "No space left on device"), as a full filesystem's write(2) does. The file itself
is created (a full disk usually still has inodes); kvmem's own code above the write runs
unchanged. Why this layer and not a real full filesystem: a small tmpfs or loop mount needs
CAP_SYS_ADMIN, which a default (unprivileged) container lacks even as root; RLIMIT_FSIZE is
per process, and says EFBIG of any file (logs included), not ENOSPC of one folder; libfaketime-
style LD_PRELOAD shims need a C compiler. `io.open` is where kvmem writes blobs (kv/store.py:
os.fdopen, Path.open), so faulting it there exercises the real path of a failed blob write.

Clock (FAULTS_CLOCK_FILE: a file holding a number of seconds): time.time() returns the real
wall clock plus that offset, re-read at most every 50 ms, as if the host's clock had been
stepped (monotonic clocks are untouched, as NTP steps leave them).
"""

import errno
import io
import os
import time

_real_open = io.open


class _FullDisk:
    """A file whose writes fail as a full disk's do; everything else is the real file's."""

    def __init__(self, raw, path: str) -> None:
        self._raw, self._path = raw, path

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self._path)

    def writelines(self, lines):
        self.write(b"")

    def __getattr__(self, name):
        return getattr(self._raw, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._raw.close()

    def __iter__(self):
        return iter(self._raw)


def _install_enospc(roots: list[str], flag: str) -> None:
    roots = [os.path.realpath(r) + os.sep for r in roots if r]

    def faulty_open(file, mode="r", *args, **kwargs):
        f = _real_open(file, mode, *args, **kwargs)
        if not any(c in mode for c in "wax+") or not os.path.exists(flag):
            return f
        try:
            path = os.readlink(f"/proc/self/fd/{f.fileno()}")
        except OSError:
            path = os.path.realpath(file) if isinstance(file, (str, bytes, os.PathLike)) else ""
        if any(path.startswith(r) for r in roots):
            return _FullDisk(f, path)
        return f

    io.open = faulty_open


def _install_clock(path: str) -> None:
    real_time, monotonic = time.time, time.monotonic
    state = {"offset": 0.0, "read_at": float("-inf")}

    def offset() -> float:
        now = monotonic()
        if now - state["read_at"] > 0.05:
            state["read_at"] = now
            try:
                with _real_open(path) as f:
                    state["offset"] = float(f.read().strip() or 0)
            except (OSError, ValueError):
                state["offset"] = 0.0
        return state["offset"]

    time.time = lambda: real_time() + offset()


if os.environ.get("FAULTS_ENOSPC_FLAG"):
    _install_enospc(os.environ.get("FAULTS_ENOSPC_ROOTS", "").split(os.pathsep), os.environ["FAULTS_ENOSPC_FLAG"])
if os.environ.get("FAULTS_CLOCK_FILE"):
    _install_clock(os.environ["FAULTS_CLOCK_FILE"])
