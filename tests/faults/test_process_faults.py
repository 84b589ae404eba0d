"""Process faults, injected into real processes under a steady light load of adds and chats:

- a replica that accepts connections and never answers, and one that answers slowly (a proxy in
  front of a real `kvmem replica`, given to a `kvmem gateway` beside the replica's own address):
  the gateway gives the silent one up and answers on the other, never waits out its reply
  timeout, and waits for the slow one rather than giving it up;
- SIGTERM to a gateway and to `kvmem serve`: the requests in flight finish, new ones get a 503
  with Retry-After while they do, and no acknowledged write is lost (the restarted gateway, and
  the served SQLite file, have every one);
- vLLM's engine-core process SIGKILLed inside `kvmem serve`: callers get 503s (never a hang, a 500
  or a dropped connection) until the server has rebuilt its engine, and chats are answered again.

Few processes, shared: one replica, one gateway (restarted once), one `kvmem serve`. The
measured numbers go to the summary table (tests/faults/conftest.py) and docs/reliability.md.
"""

from __future__ import annotations

import signal
import sqlite3
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest

from kvmem.bench.servers import KvmemProcess
from kvmem.config import default_home
from kvmem.engine import health, watched
from kvmem.engine.remote import rendezvous
from tests.faults.replica_proxy import ReplicaProxy

START_S = 600  # cold CPU starts of vLLM on a loaded machine
ENV = {"KVMEM_READER_ADAPTER": "off",  # LoRA slows CPU decode steps; the adapter is tested elsewhere
       "KVMEM_GPU_MEMORY_UTILIZATION": "0.1",  # two engines share this host's memory (CPU: a share of RAM)
       "KVMEM_CPU_KV_SPACE_GIB": "1"}  # and a light load needs little KV cache
# The 503s these faults may cause, each documented (docs/server.md, docs/reliability.md).
RETRY_LATER = {"shutting_down", "engine_restarting", "engine_loading"}  # with Retry-After
ENGINE_FAILED = "engine_unavailable"  # a request in flight when the engine died
# The longest a request can wait on a silent replica: SILENT_AFTER probes in a row unanswered, each
# round probing every replica (a silent one takes the whole probe timeout), then one watch slice.
SILENT_WAIT_S = (health.SILENT_AFTER + 1) * (health.PROBE_S + 2 * health.PROBE_TIMEOUT_S) + watched.WATCH_S


# -- the processes -------------------------------------------------------------------------------

def _start(name: str, home: Path, args: list[str], env: dict) -> KvmemProcess:
    return KvmemProcess(name, home, args, {**ENV, **env}, default_home() / "models")


def _wait(proc: KvmemProcess, path: str) -> KvmemProcess:
    try:
        return proc.wait(path, START_S)
    except (RuntimeError, TimeoutError) as e:
        pytest.fail(str(e))


@dataclass
class Topology:
    replica: KvmemProcess
    proxy: ReplicaProxy  # in front of the same replica: the gateway sees two replicas
    gateway: KvmemProcess
    gateway_args: list[str]
    gateway_env: dict
    db_url: str
    serve: KvmemProcess


@pytest.fixture(scope="module")
def topo(tmp_path_factory, postgres_url, redis_url):
    """A replica and a `kvmem serve` started together (their engines load side by side), then a
    gateway whose replicas are the proxy and the replica itself."""
    import psycopg

    db = f"process_faults_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {db}")
    db_url = postgres_url.rsplit("/", 1)[0] + "/" + db
    stores = {"KVMEM_KV_SHARED_URL": redis_url}
    replica = _start("replica", tmp_path_factory.mktemp("replica"), ["replica"], stores)
    serve = _start("serve", tmp_path_factory.mktemp("serve"), ["serve"], {})
    procs, proxy, t = [replica, serve], None, None
    try:
        _wait(replica, "/v1/models")
        proxy = ReplicaProxy("127.0.0.1", replica.port)
        args = ["gateway", "--replicas", f"{proxy.url},{replica.url}", "--database-url", db_url]
        gateway = _start("gateway", tmp_path_factory.mktemp("gateway"), args, stores)
        procs.append(gateway)
        _wait(gateway, "/health")
        _wait(serve, "/health")
        t = Topology(replica, proxy, gateway, args, stores, db_url, serve)
        yield t
    finally:
        for p in [*procs, *([t.gateway] if t else [])]:
            p.stop()
        if proxy is not None:
            proxy.close()


# -- load and answers ----------------------------------------------------------------------------

@dataclass
class Answer:
    kind: str  # "add" | "chat" | "stream"
    user: str
    text: str
    sent: float  # time.monotonic()
    took_s: float
    status: int  # 0: no HTTP answer (connection refused or dropped, timed out)
    code: str | None = None
    retry_after: str | None = None
    fact_id: str | None = None
    error: str = ""


def _send(url: str, kind: str, user: str, text: str, max_tokens: int = 8, timeout: float = 120,
          **fields) -> Answer:
    sent = time.monotonic()
    try:
        with httpx.Client(base_url=url, timeout=timeout) as c:
            if kind == "add":
                r = c.post("/v1/memories", json={"user_id": user, "facts": [text], "encode": "sync"})
            else:
                r = c.post("/v1/chat/completions", json={
                    "model": "kvmem", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                    "stream": kind == "stream", "memory": {"user_id": user, "k": 2, "mode": "kv"}, **fields})
                if kind == "stream" and r.status_code == 200 and not r.text.rstrip().endswith("data: [DONE]"):
                    return Answer(kind, user, text, sent, time.monotonic() - sent, 0, error="stream cut short")
    except httpx.HTTPError as e:
        return Answer(kind, user, text, sent, time.monotonic() - sent, 0, error=repr(e))
    error = r.json().get("error") or {} if r.headers.get("content-type", "").startswith("application/json") else {}
    fact = r.json()["results"][0]["id"] if kind == "add" and r.status_code == 200 else None
    return Answer(kind, user, text, sent, time.monotonic() - sent, r.status_code, error.get("code"),
                  r.headers.get("retry-after"), fact, "" if r.status_code < 400 else r.text[:300])


class Load:
    """`chatters` threads chatting and `writers` threads adding one new fact each call (sync encode),
    at `url()` (read per call: a restarted server has a new port), until stopped."""

    def __init__(self, url, users: list[str], chatters: int = 2, writers: int = 1, pause_s: float = 0.2,
                 kind: str = "chat") -> None:
        self.url, self.users, self.pause_s = url, users, pause_s
        self.answers: list[Answer] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(kind, i), daemon=True) for i in range(chatters)]
        self._threads += [threading.Thread(target=self._run, args=("add", i), daemon=True) for i in range(writers)]

    def __enter__(self) -> "Load":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(180)

    def _run(self, kind: str, i: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            user = self.users[(i + n) % len(self.users)]
            text = f"Load fact {uuid.uuid4().hex[:6]}: I own {n} kites." if kind == "add" else "How many kites?"
            self.answers.append(_send(self.url(), kind, user, text))
            self._stop.wait(self.pause_s)


def _tally(answers: list[Answer], row: dict, allowed: set[str]) -> None:
    """Every answer is a 200 or a documented 503 (`allowed` codes; those in RETRY_LATER carry
    Retry-After): no 500, no hang, no dropped connection. Fills the summary row's counts."""
    def documented(a: Answer) -> bool:
        return a.status == 503 and a.code in allowed and (a.code not in RETRY_LATER or (a.retry_after or "").isdigit())

    bad = [a for a in answers if a.status != 200 and not documented(a)]
    row["5xx"] += sum(a.status >= 500 and not documented(a) for a in answers)
    row["503"] += sum(documented(a) for a in answers)
    row["acked"] += sum(a.kind == "add" and a.status == 200 for a in answers)
    assert not bad, [f"{a.kind} {a.status} {a.code} {a.error}" for a in bad[:5]]


def _users_on(url: str, urls: list[str], prefix: str, n: int) -> list[str]:
    """User ids whose first-choice replica (rendezvous, as the gateway routes) is `url`."""
    users = (f"{prefix}-{uuid.uuid4().hex[:6]}-{i}" for i in range(100000))
    return [u for u, _ in zip((u for u in users if rendezvous(u, urls)[0] == url), range(n))]


def _answered(gateway: KvmemProcess, url: str, affinity: str) -> float:
    """kvmem_replica_requests_total for that replica and affinity, from the gateway's /metrics."""
    series = f'kvmem_replica_requests_total{{affinity="{affinity}",replica="{url}"}}'
    lines = httpx.get(gateway.url + "/metrics", timeout=30).text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(series))


def _lost(db_url: str | None, sqlite: Path | None, acked: list[Answer]) -> list[tuple]:
    """Acknowledged adds missing from the facts store (or stored with another text)."""
    if db_url:
        import psycopg

        conn = psycopg.connect(db_url)
    else:
        conn = sqlite3.connect(sqlite)
    try:
        q = "SELECT text FROM facts WHERE id = %s" if db_url else "SELECT text FROM facts WHERE id = ?"
        rows = {a.fact_id: conn.execute(q, (a.fact_id,)).fetchone() for a in acked}
    finally:
        conn.close()
    return [(a.fact_id, a.text, rows[a.fact_id]) for a in acked if rows[a.fact_id] != (a.text,)]


# -- a replica that hangs, and one that is slow --------------------------------------------------

def test_a_hung_replica_is_given_up_and_its_users_answered_by_the_other(topo, fault_row):
    """The proxy swallows every request and answers nothing (the gateway's probes too). Chats of
    users whose first choice it is, in flight or new, are answered by the other replica within
    the probes' silence verdict, not after the 600 s reply timeout; streamed ones too, since
    nothing had reached the caller. Healed, the replica gets its users back."""
    fault_row["fault"] = "a replica hangs (accepts, never answers)"
    urls = [topo.proxy.url, topo.replica.url]
    users = _users_on(topo.proxy.url, urls, "hang", 3)
    for u in users:
        assert _send(topo.gateway.url, "add", u, "I own three red kites.").status == 200
    baseline = [_send(topo.gateway.url, "chat", u, "How many kites?") for u in users]
    assert all(a.status == 200 for a in baseline)
    with Load(lambda: topo.gateway.url, users, chatters=2, writers=1) as load:
        time.sleep(2)
        topo.proxy.set("hang")
        hung_at = time.monotonic()
        # Sent after the hang, it waits for the probes' verdict like the requests in flight then.
        streamed = _send(topo.gateway.url, "stream", users[0], "How many kites?")
        time.sleep(1)  # requests sent once the replica is passed over go straight to the other
    first_before = _answered(topo.gateway, topo.proxy.url, "first")
    during = [a for a in load.answers if a.sent >= hung_at - 1] + [streamed]
    _tally(load.answers + [streamed], fault_row, allowed=set())
    worst = max(a.took_s for a in during)
    slowest_before = max(a.took_s for a in baseline + [a for a in load.answers if a.sent < hung_at - 1])
    print(f"\nhung replica: worst chat {worst:.1f} s (bound {SILENT_WAIT_S + slowest_before:.1f} s), "
          f"slowest before {slowest_before:.1f} s, streamed {streamed.took_s:.1f} s")
    assert worst <= SILENT_WAIT_S + slowest_before, worst
    assert _answered(topo.gateway, topo.replica.url, "other") > 0  # the proxy's users, on the replica
    topo.proxy.set("forward")
    healed = time.monotonic()
    while _send(topo.gateway.url, "chat", users[0], "How many kites?").status != 200 or \
            _answered(topo.gateway, topo.proxy.url, "first") <= first_before:
        assert time.monotonic() - healed < 60, "the healed replica never got its users back"
        time.sleep(0.5)
    fault_row["recovery_s"] = worst  # the longest a caller waited while the replica hung


def test_a_slow_replica_is_waited_for_not_given_up(topo, fault_row):
    """The proxy holds each completion's reply for longer than the probes need to call a replica
    silent, while its model list answers at once (a long prefill looks like this): the chat is
    answered by that replica, late, and nothing fails over."""
    fault_row["fault"] = "a replica answers slowly (replies held back)"
    urls = [topo.proxy.url, topo.replica.url]
    users = _users_on(topo.proxy.url, urls, "slow", 2)
    hold = SILENT_WAIT_S + 1.0
    first = _answered(topo.gateway, topo.proxy.url, "first")
    other = _answered(topo.gateway, topo.replica.url, "other")
    topo.proxy.set("hold", hold)
    try:
        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda u: _send(topo.gateway.url, "chat", u, "How many kites?"), users))
    finally:
        topo.proxy.set("forward")
    _tally(answers, fault_row, allowed=set())
    print(f"\nslow replica: held {hold:.1f} s, chats took {[round(a.took_s, 1) for a in answers]} s")
    assert all(a.took_s >= hold for a in answers)  # they did wait for the slow replica
    assert _answered(topo.gateway, topo.proxy.url, "first") == first + len(users)
    assert _answered(topo.gateway, topo.replica.url, "other") == other  # nothing went elsewhere
    fault_row["recovery_s"] = 0.0


# -- SIGTERM -------------------------------------------------------------------------------------

def _drain(proc: KvmemProcess, users: list[str], row: dict, db_url: str | None, sqlite: Path | None) -> None:
    """SIGTERM to the server process alone (as `docker stop` sends it) under load, with a streamed
    chat in flight: it finishes, a request sent while it does gets 503 shutting_down with
    Retry-After, the process exits, and every acknowledged add is in the facts store."""
    with Load(lambda: proc.url, users, chatters=2, writers=2) as load:
        time.sleep(3)
        with ThreadPoolExecutor(1) as pool:
            # The end-of-sequence token banned: the answer runs to max_tokens, still going at the signal.
            long = pool.submit(_send, proc.url, "stream", users[0], "Tell me about kites.", 48,
                               logit_bias={str(_eos_id()): -100})
            time.sleep(1.0)  # the stream is being answered
            proc.proc.send_signal(signal.SIGTERM)
            termed = time.monotonic()
            time.sleep(0.3)
            refused = _send(proc.url, "chat", users[1], "How many kites?")
            in_flight = long.result()
        try:
            proc.proc.wait(120)
        except Exception:  # noqa: BLE001 - reported below
            pytest.fail(f"{proc.name} did not exit after SIGTERM:\n{proc.tail()}")
        stopped = time.monotonic() - termed
    # After the exit nothing listens: those are refused connections, not answers.
    answers = [a for a in load.answers if a.status or a.sent < termed] + [in_flight, refused]
    print(f"\nin flight at SIGTERM: {[(a.kind, a.status, round(a.took_s, 1)) for a in answers if a.sent < termed < a.sent + a.took_s]}")
    _tally(answers, row, allowed={"shutting_down"})
    assert in_flight.status == 200, in_flight
    assert refused.status == 503 and refused.code == "shutting_down" and refused.retry_after.isdigit(), refused
    acked = [a for a in answers if a.kind == "add" and a.status == 200]
    lost = _lost(db_url, sqlite, acked)
    row["lost"] += len(lost)
    assert acked and not lost, lost
    print(f"\nSIGTERM {proc.name}: exited {stopped:.1f} s after it, {len(acked)} acked adds, none lost; "
          f"{sum(a.code == 'shutting_down' for a in answers)} 503s while draining")
    row["recovery_s"] = stopped


def _eos_id() -> int:
    import json

    from kvmem.model import resolve_model

    model = resolve_model(None, default_home() / "models")
    return json.loads((Path(model.path) / "generation_config.json").read_text())["eos_token_id"]


def test_sigterm_drains_a_gateway_and_the_restarted_one_has_every_acked_write(topo, fault_row, tmp_path_factory):
    fault_row["fault"] = "SIGTERM to a gateway under load (drain, restart)"
    users = [f"term-{uuid.uuid4().hex[:6]}-{i}" for i in range(3)]
    for u in users:
        assert _send(topo.gateway.url, "add", u, "I own two kites.").status == 200
    old = topo.gateway
    _drain(old, users, fault_row, topo.db_url, None)
    started = time.monotonic()
    topo.gateway = _wait(_start("gateway-2", old.home, topo.gateway_args, topo.gateway_env), "/health")
    with httpx.Client(base_url=topo.gateway.url, timeout=60) as c:
        r = c.get("/v1/memories", params={"user_id": users[0]})
        assert r.status_code == 200 and r.json()["results"]
    print(f"gateway restarted in {time.monotonic() - started:.1f} s")


# -- vLLM's engine dying inside kvmem serve -------------------------------------------------------

def _engine_core(proc: KvmemProcess) -> psutil.Process:
    """vLLM's engine-core process under `kvmem serve` (its title is VLLM::EngineCore)."""
    def is_core(p: psutil.Process) -> bool:
        try:
            return p.status() != psutil.STATUS_ZOMBIE and "EngineCore" in " ".join(p.cmdline())
        except psutil.Error:  # gone meanwhile
            return False

    cores = [p for p in psutil.Process(proc.proc.pid).children(recursive=True) if is_core(p)]
    assert len(cores) == 1, cores
    return cores[0]


def test_the_engine_dying_inside_serve_gives_503s_until_it_is_rebuilt(topo, fault_row):
    """SIGKILL to vLLM's engine-core process while chats and adds run: requests in flight get 503
    engine_unavailable, new ones 503 engine_restarting with Retry-After, none hangs (the client
    waits 120 s) and none is a 500; the server rebuilds its engine and answers chats again."""
    fault_row["fault"] = "vLLM's engine process killed inside kvmem serve (under load)"
    serve = topo.serve
    users = [f"core-{uuid.uuid4().hex[:6]}-{i}" for i in range(3)]
    for u in users:
        assert _send(serve.url, "add", u, "I own four kites.").status == 200
    core = _engine_core(serve)
    with Load(lambda: serve.url, users, chatters=2, writers=1) as load:
        time.sleep(3)
        core.kill()
        killed = time.monotonic()
        served_again = None
        while served_again is None:
            a = _send(serve.url, "chat", users[0], "How many kites?")
            load.answers.append(a)
            if a.status == 200 and a.sent > killed:
                served_again = time.monotonic() - killed
            assert time.monotonic() - killed < START_S, "the engine was not rebuilt"
            time.sleep(0.5)
    after = [a for a in load.answers if a.sent >= killed]
    _tally(load.answers, fault_row, allowed=RETRY_LATER | {ENGINE_FAILED})
    assert any(a.status == 503 for a in after)  # the death was seen, and said
    assert max(a.took_s for a in after) < 60  # nothing waited on the dead engine
    acked = [a for a in load.answers if a.kind == "add" and a.status == 200]
    lost = _lost(None, serve.home / "facts.sqlite", acked)
    fault_row["lost"] += len(lost)
    assert not lost, lost
    new_core = _engine_core(serve)
    assert new_core.pid != core.pid
    fault_row["recovery_s"] = served_again
    print(f"\nengine died: chats served again after {served_again:.1f} s; "
          f"{sum(a.status == 503 for a in after)} 503s meanwhile, slowest answer {max(a.took_s for a in after):.1f} s")


def test_sigterm_drains_kvmem_serve_and_its_store_has_every_acked_write(topo, fault_row):
    fault_row["fault"] = "SIGTERM to kvmem serve under load (drain)"
    users = [f"serve-term-{uuid.uuid4().hex[:6]}-{i}" for i in range(3)]
    for u in users:
        assert _send(topo.serve.url, "add", u, "I own five kites.").status == 200
    _drain(topo.serve, users, fault_row, None, topo.serve.home / "facts.sqlite")
