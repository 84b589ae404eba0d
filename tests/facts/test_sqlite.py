"""The SQLite file shared by two processes: the one that serves it, and one that opens it beside
(a CLI next to a server, a probe after a restart). See the module docstring of kvmem/facts/sqlite.py."""

import subprocess
import sys

from kvmem.facts import FactStore
from kvmem.facts.scope import Scope

ALICE = Scope("alice")

COUNT = "import sys; from kvmem.facts import FactStore; s = FactStore(sys.argv[1]); print(s.count()); s.close()"


def count_in_another_process(path) -> int:
    """Open the store in a fresh interpreter, count its facts, close it (its last-connection check runs)."""
    run = subprocess.run([sys.executable, "-c", COUNT, str(path)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    return int(run.stdout.split()[-1])


def wal_files(path):
    return [p for p in (path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")) if p.exists()]


def test_another_process_closing_beside_a_serving_store_leaves_its_wal_alone(tmp_path):
    """Regression: closing any descriptor of the file in the serving process (here a read of it,
    as tests/test_service.py once did) dropped SQLite's POSIX locks there; the next process to
    close its connection then thought itself the last one and deleted the -wal and -shm files
    under the live store. Its later commits went to an unlinked WAL ("1" below, not 51), and its
    next connection failed with "sqlite3.OperationalError: disk I/O error"."""
    path = tmp_path / "facts.sqlite"
    served = FactStore(path)
    try:
        served.add(ALICE, "before")
        path.read_bytes()  # opens and closes the file in this process
        assert count_in_another_process(path) == 1
        for i in range(50):
            served.add(ALICE, f"after {i}")
        with FactStore(path) as again:  # a second connection of the serving process
            assert again.count() == 51
        assert count_in_another_process(path) == 51
        assert served.count() == 51
    finally:
        served.close()
    assert wal_files(path) == []  # the last store out still checkpoints and removes them


def test_a_store_alone_removes_its_wal_files_on_close(tmp_path):
    path = tmp_path / "facts.sqlite"
    first, second = FactStore(path), FactStore(path)
    first.add(ALICE, "one")
    first.close()
    assert len(wal_files(path)) == 2 and second.count() == 1  # the other store of this process still uses them
    second.add(ALICE, "two")
    second.close()
    assert wal_files(path) == []
    assert count_in_another_process(path) == 2


def test_a_store_dropped_without_close_gives_its_guard_back(tmp_path):
    import gc

    from kvmem.facts import sqlite

    path = tmp_path / "facts.sqlite"
    FactStore(path).add(ALICE, "one")  # never closed
    gc.collect()  # its sqlite3 connection too, which a cycle may keep a while
    key = (path.stat().st_dev, path.stat().st_ino)
    assert key in sqlite._GUARDS._dropped  # noted by its finalizer, which takes no lock
    with FactStore(path) as again:
        assert again.count() == 1
        assert sqlite._GUARDS._held[key][1] == 1 and key not in sqlite._GUARDS._dropped
    assert key not in sqlite._GUARDS._held and wal_files(path) == []
