"""The scale-out topology on one machine, loopback only: PostgreSQL, Redis, two vLLM replicas
(`kvmem replica`, the bundled model on the CPU backend, each with its own local KV folder) and two
gateways (`kvmem gateway`, each with its own data folder). Everything is a real process.

Shown here: a fact added through gateway A is answered through gateway B in KV mode; forgetting
through one gateway removes the fact from PostgreSQL, Redis and every replica's local folder; a
replica SIGKILLed under a bounded load loses no acknowledged write, and every chat completes (on
the other replica, which pulls the blobs it lacks from Redis) or gets a clear 503. An agent's MCP
client at a gateway's /mcp (a third gateway, the one with API keys) stores facts in the same
PostgreSQL, encoded by the replicas, that its tenant's chats inject, and another tenant sees none.
Two gateways under a write burst encode each fact once (a lease per fact and model, facts/leases.py).
A gateway routing by residency sends a chat to the replica whose RAM tier holds its facts' KV.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from kvmem.bench.oracle import logprob_gap
from kvmem.config import default_home
from kvmem.engine.remote import rendezvous
from kvmem.bench.servers import KvmemProcess

# After every other server test: the topology stops the shared server to make room for its
# replicas, and a server test after it would start that server again (~30 s on these hosts).
pytestmark = pytest.mark.last

START_S = 600  # cold CPU starts of vLLM: ~1 minute each here, more on a loaded CI machine
KEYS = {"alpha": "sk-topology-alpha", "beta": "sk-topology-beta"}  # the keyed gateway's tenants
ENV = {"KVMEM_READER_ADAPTER": "off",  # LoRA slows CPU decode steps; the adapter is tested elsewhere
       # The suite's own engines run beside these replicas (three at most) on 24 GiB: 1 GiB of KV
       # each (VLLM_CPU_KVCACHE_SPACE, not the share: the CPU backend sizes its cache by it).
       "KVMEM_CPU_KV_SPACE_GIB": "1", "KVMEM_GPU_MEMORY_UTILIZATION": "0.05"}


def _start(name: str, home: Path, args: list[str], env: dict) -> KvmemProcess:
    return KvmemProcess(name, home, args, {**ENV, **env}, default_home() / "models")


def _wait(proc: KvmemProcess, path: str) -> None:
    try:
        proc.wait(path, START_S)
    except (RuntimeError, TimeoutError) as e:
        pytest.fail(str(e))


@pytest.fixture(scope="module")
def topology(tmp_path_factory, postgres_url, redis_url, servers):
    import psycopg

    servers.close()  # the shared server's engine is not needed here; the next server test restarts it
    db = f"topology_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {db}")
    db_url = postgres_url.rsplit("/", 1)[0] + "/" + db
    stores = {"KVMEM_KV_SHARED_URL": redis_url}
    # Each replica registers itself in PostgreSQL's membership table while it serves (gateways A
    # and B are given a static --replicas list all the same; the members gateway reads the table).
    registered = ["replica", "--database-url", db_url, "--drain-seconds", "0"]
    replicas = [_start(f"replica-{i}", tmp_path_factory.mktemp(f"replica-{i}"), registered, stores) for i in (1, 2)]
    procs = list(replicas)
    try:
        for r in replicas:
            _wait(r, "/v1/models")
        urls = ",".join(r.url for r in replicas)
        gateways = [_start(f"gateway-{n}", tmp_path_factory.mktemp(f"gateway-{n}"),
                           ["gateway", "--replicas", urls, "--database-url", db_url], stores) for n in "ab"]
        procs += gateways
        for g in gateways:
            _wait(g, "/health")
        yield {"replicas": replicas, "gateways": gateways, "db_url": db_url, "redis_url": redis_url}
    finally:
        for p in procs:
            p.stop()


@pytest.fixture(scope="module")
def keyed_gateway(topology, tmp_path_factory):
    """One more gateway on the topology's replicas, PostgreSQL and Redis, with API keys (A and B
    are open, so every caller is one tenant there). It starts no engine: it sends to the replicas."""
    urls = ",".join(r.url for r in topology["replicas"])
    env = {"KVMEM_KV_SHARED_URL": topology["redis_url"],
           "KVMEM_API_KEYS": ",".join(f"{tenant}={key}" for tenant, key in KEYS.items())}
    gateway = _start("gateway-keyed", tmp_path_factory.mktemp("gateway-keyed"),
                     ["gateway", "--replicas", urls, "--database-url", topology["db_url"]], env)
    try:
        _wait(gateway, "/health")
        yield gateway
    finally:
        gateway.stop()


@pytest.fixture(scope="module")
def members_gateway(topology, tmp_path_factory):
    """A gateway with no --replicas: it routes to the replicas registered in the membership table."""
    gateway = _start("gateway-members", tmp_path_factory.mktemp("gateway-members"),
                     ["gateway", "--database-url", topology["db_url"]], {"KVMEM_KV_SHARED_URL": topology["redis_url"]})
    try:
        _wait(gateway, "/health")
        yield gateway
    finally:
        gateway.stop()


@pytest.fixture(scope="module")
def residency_gateway(topology, tmp_path_factory):
    """A gateway routing KV-mode chats by residency (engine.routing): to the replica whose RAM
    tier holds the chat's facts, as the replicas publish it in Redis."""
    urls = ",".join(r.url for r in topology["replicas"])
    gateway = _start("gateway-residency", tmp_path_factory.mktemp("gateway-residency"),
                     ["gateway", "--replicas", urls, "--database-url", topology["db_url"], "--routing", "residency"],
                     {"KVMEM_KV_SHARED_URL": topology["redis_url"]})
    try:
        _wait(gateway, "/health")
        yield gateway
    finally:
        gateway.stop()


def _client(proc: KvmemProcess, tenant: str | None = None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"} if tenant else {}
    return httpx.Client(base_url=proc.url, timeout=300, headers=headers)


def _add(gateway: KvmemProcess, user: str, facts: list[str]) -> list[str]:
    with _client(gateway) as c:
        r = c.post("/v1/memories", json={"user_id": user, "facts": facts, "encode": "sync"})
    assert r.status_code == 200, r.text
    return [m["id"] for m in r.json()["results"]]


def _chat(client: httpx.Client, user: str, question: str, mode: str = "kv", k: int = 1) -> httpx.Response:
    return client.post("/v1/chat/completions", json={
        "model": "kvmem", "messages": [{"role": "user", "content": question}], "max_tokens": 8,
        "logprobs": True, "top_logprobs": 5, "memory": {"user_id": user, "k": k, "mode": mode}})


def _first_logprobs(reply: dict) -> dict[str, float]:
    first = reply["choices"][0]["logprobs"]["content"][0]
    return {t["token"]: t["logprob"] for t in first["top_logprobs"]}


def _until(check, timeout: float = 15.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not hold within {timeout} s")
        time.sleep(0.1)


def _blob_files(replica: KvmemProcess, fact_id: str) -> list[Path]:
    return list((replica.home / "kv").glob(f"*/{fact_id}.safetensors"))


def _user_on(replica: KvmemProcess, replicas: list[KvmemProcess], prefix: str) -> str:
    """A user id whose first-choice replica (rendezvous hashing, as the gateways route) is `replica`."""
    urls = [r.url for r in replicas]
    return next(u for u in (f"{prefix}-{i}" for i in range(1000)) if rendezvous(u, urls)[0] == replica.url)


def test_a_fact_added_through_gateway_a_is_answered_through_gateway_b_in_kv_mode(topology):
    a, b = topology["gateways"]
    user = f"alice-{uuid.uuid4().hex[:6]}"
    (fact,) = _add(a, user, ["My dog is called Biscuit and loves carrots."])
    with _client(b) as c:
        # B's index hears A's write through PostgreSQL's change feed, not at once.
        _until(lambda: c.post("/v1/memories/search", json={"user_id": user, "query": "dog"}).json()["results"],
               what="gateway B finding the fact")
        kv = _chat(c, user, "What is my dog called?").json()
    with _client(a) as c:
        text = _chat(c, user, "What is my dog called?", mode="text").json()
    assert kv["memory"]["fact_ids"] == [fact] and kv["memory"]["fallbacks"] == 0
    assert kv["memory"]["injected_tokens"] > 0  # the replica injected the blob the encode stored
    # k=1, injected where it was encoded: as exact as the engine's own prefix-cache hit.
    # Within the engine's own prefix-cache noise (tests/engine/test_replica.py says why hosts differ).
    with _client(a) as c:
        again = _chat(c, user, "What is my dog called?", mode="text").json()
    noise = logprob_gap(_first_logprobs(text), _first_logprobs(again))
    assert logprob_gap(_first_logprobs(text), _first_logprobs(kv)) <= 2 * noise + 1e-3
    if noise <= 1e-3:
        assert kv["choices"][0]["message"]["content"] == text["choices"][0]["message"]["content"]



def test_the_openai_sdk_samples_and_gets_json_through_a_gateway(topology):
    """The front door's fields carried gateway -> replica: seeded n choices reproduce, a JSON
    schema constrains the reply, a stop string ends it, logprobs come back, a forced tool call
    parses (streamed too), in kv and text mode."""
    from openai import OpenAI

    a, _ = topology["gateways"]
    user = f"sdk-{uuid.uuid4().hex[:6]}"
    _add(a, user, ["My dog is called Biscuit and loves carrots."])
    client = OpenAI(base_url=a.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16}}, "required": ["name"],
              "additionalProperties": False}
    for mode in ("kv", "text"):
        ask = dict(model="kvmem", messages=[{"role": "user", "content": "What is my dog called?"}], max_tokens=8,
                   extra_body={"memory": {"user_id": user, "k": 1, "mode": mode}})
        first, again = (client.chat.completions.create(**ask, n=2, temperature=1.0, seed=5, logprobs=True,
                                                       top_logprobs=2) for _ in range(2))
        assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
        assert len(first.choices) == 2 and all(len(c.logprobs.content[0].top_logprobs) == 2 for c in first.choices)
        greedy = client.chat.completions.create(**ask).choices[0].message.content
        word = greedy.split()[1]
        stopped = client.chat.completions.create(**ask, stop=[word]).choices[0]
        assert stopped.finish_reason == "stop" and word not in stopped.message.content
        reply = client.chat.completions.create(**{**ask, "max_tokens": 32}, response_format={
            "type": "json_schema", "json_schema": {"name": "dog", "schema": schema}}).choices[0]
        assert reply.finish_reason == "stop" and set(json.loads(reply.message.content)) == {"name"}
        _check_tool_call_through(client, ask, schema)
    _check_langchain_through(a, user)
    page = httpx.get(a.url + "/ui", timeout=60)  # the inspector is on gateways too (no keys here: open)
    assert page.status_code == 200 and user in page.text


def _check_langchain_through(gateway, user: str) -> None:
    """LangChain's ChatOpenAI at a gateway: invoke, stream, a forced tool and structured output."""
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    class Dog(BaseModel):
        name: str

    llm = ChatOpenAI(base_url=gateway.url + "/v1", api_key="unused", model="kvmem", temperature=0, max_retries=0,
                     timeout=300, max_tokens=32, extra_body={"memory": {"user_id": user, "k": 1, "mode": "kv"}})
    answer = llm.invoke("What is my dog called?").content
    assert answer.strip() and "".join(c.content for c in llm.stream("What is my dog called?")) == answer
    (call,) = llm.bind_tools([Dog], tool_choice="Dog").invoke("What is my dog called?").tool_calls
    assert call["name"] == "Dog" and Dog.model_validate(call["args"])
    assert isinstance(llm.with_structured_output(Dog, method="json_schema").invoke("My dog's name, as JSON."), Dog)


def _check_tool_call_through(client, ask: dict, schema: dict) -> None:
    """A forced tool call (the calls' schema goes to the replica as structured output), streamed too."""
    tool = {"type": "function", "function": {"name": "name_dog", "parameters": schema}}
    forced = {**ask, "max_tokens": 96, "tools": [tool], "tool_choice": "required", "parallel_tool_calls": False}
    choice = client.chat.completions.create(**forced).choices[0]
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and call.function.name == "name_dog"
    assert set(json.loads(call.function.arguments)) == {"name"}
    deltas = [d for chunk in client.chat.completions.create(**forced, stream=True) for c in chunk.choices
              for d in c.delta.tool_calls or ()]
    assert "".join(d.function.arguments for d in deltas) == call.function.arguments


def test_forgetting_through_one_gateway_removes_the_fact_from_every_store(topology):
    import psycopg
    import redis

    from kvmem.kv.store import KVStore

    a, b = topology["gateways"]
    replicas = topology["replicas"]
    user = _user_on(replicas[0], replicas, "forget")
    (fact,) = _add(a, user, ["My locker code is 4417."])
    # Encoded on the user's replica, kept in its local folder. The sync add returns once the blob
    # is in the shared tier, which a store writes first; the local file lands just after it.
    _until(lambda: _blob_files(replicas[0], fact), what="the user's replica keeping its local copy")
    # The other replica's local folder gets a copy the way its connector would: pulled from Redis.
    other = KVStore(replicas[1].home / "kv", _fingerprint(), 0, shared_url=topology["redis_url"])
    other.token_ids(fact)
    other.close()
    assert _blob_files(replicas[1], fact)
    r = redis.Redis.from_url(topology["redis_url"])
    assert [k for k in r.scan_iter(f"*{fact}*")]

    with _client(b) as c:
        _until(lambda: c.get(f"/v1/memories/{fact}").status_code == 200, what="gateway B seeing the fact")
        assert c.delete(f"/v1/memories/{fact}").status_code == 200
    with psycopg.connect(topology["db_url"]) as conn:
        assert conn.execute("SELECT count(*) FROM facts WHERE id = %s", (fact,)).fetchone()[0] == 0
    assert not [k for k in r.scan_iter(f"*{fact}*")]
    for replica in replicas:  # each replica process drops its copy when Redis announces the forget
        _until(lambda: not _blob_files(replica, fact), what=f"{replica.name} dropping its copy")
    with _client(a) as c:
        assert c.get(f"/v1/memories/{fact}").status_code == 404
        _until(lambda: not c.post("/v1/memories/search", json={"user_id": user, "query": "locker"}).json()["results"],
               what="gateway A's index dropping the fact")


def _fingerprint() -> str:
    from kvmem.model import resolve_model

    return resolve_model(None, default_home() / "models").fingerprint



def test_an_mcp_client_at_a_gateway_stores_in_the_shared_store_its_tenant_only(topology, keyed_gateway):
    """The `mcp` SDK's client at a gateway's /mcp, as tests/mcp/test_http.py connects to `kvmem serve`:
    the tools list, a memory added and found, the row in the topology's PostgreSQL under the
    tenant's user id, its blob encoded by a replica and injected in the tenant's KV-mode chat;
    another tenant's key, same user id, reaches none of it."""
    import anyio
    import psycopg

    from tests.mcp import contract
    from tests.mcp.test_http import session

    user = f"mcp-{uuid.uuid4().hex[:6]}"
    text = "My bicycle is a green Brompton called Fern."

    async def scenario():
        async with session(keyed_gateway, KEYS["alpha"], user) as alpha:
            await contract.lists_the_tools(alpha)
            added = await contract.call(alpha, "add_memory", text=text, metadata={"topic": "bike"})
            ((fact, event),) = [(r["id"], r["event"]) for r in added["results"]]
            hits = (await contract.call(alpha, "search_memories", query="What bicycle do I ride?", limit=1))["results"]
            async with session(keyed_gateway, KEYS["beta"], user) as beta:
                assert (await contract.call(beta, "search_memories", query="What bicycle do I ride?"))["results"] == []
                assert "not_found" in await contract.error(beta, "get_memory", memory_id=fact)
                await contract.another_tenant_sees_nothing(alpha, beta)  # list, search, get, update, delete
        return fact, event, hits

    fact, event, hits = anyio.run(scenario)
    assert event == "ADD"
    assert [(h["id"], h["memory"], h["user_id"], h["metadata"]) for h in hits] == [(fact, text, user, {"topic": "bike"})]
    with psycopg.connect(topology["db_url"]) as conn:  # the gateways' one fact store
        row = conn.execute("SELECT user_id, text FROM facts WHERE id = %s", (fact,)).fetchone()
    assert row == (f"alpha::{user}", text)
    # add_memory encodes in the background: a replica makes the blob and keeps a local copy.
    _until(lambda: any(_blob_files(r, fact) for r in topology["replicas"]), timeout=120,
           what="a replica encoding the MCP-added fact")
    with _client(keyed_gateway, "alpha") as c:
        _until(lambda: c.get(f"/v1/memories/{fact}").json()["kv_status"] == "encoded", timeout=60,
               what="the fact's kv_status turning encoded")
        kv = _chat(c, user, "What is my bicycle called?").json()
    assert kv["memory"]["fact_ids"] == [fact] and kv["memory"]["fallbacks"] == 0, kv
    assert kv["memory"]["injected_tokens"] > 0
    with _client(keyed_gateway, "beta") as c:
        assert c.get(f"/v1/memories/{fact}").status_code == 404
        assert c.post("/v1/memories/search", json={"user_id": user, "query": "bicycle"}).json()["results"] == []


def _scraped(url: str, name: str) -> float:
    """The sum of a metric's samples (every label set) at url/metrics; 0 from a process that is
    gone (the SIGKILL test leaves its victim dead: it counts nothing before or after)."""
    try:
        text = httpx.get(url + "/metrics", timeout=30).text
    except httpx.TransportError:
        return 0.0
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and line[len(name)] in " {")


def test_two_gateways_under_a_write_burst_encode_each_fact_once(topology, keyed_gateway):
    """Issue 54: writes through both gateways at once, half encoded at once (sync), half left to
    the background; both gateways' encoders see every pending fact in PostgreSQL, and each fact's
    lease lets one of them encode it. Counted twice: ENCODE requests the replicas finished (their
    own vLLM counter; nothing else runs meanwhile) and facts the gateways sent (the keyed gateway's
    encoder works the same queue: counted too). Before leases: 48 facts, 143 encodes."""
    import psycopg

    gateways, replicas = topology["gateways"], topology["replicas"]
    encoders = [*gateways, keyed_gateway]
    tag = uuid.uuid4().hex[:6]
    for g in gateways:  # a gateway's first encode also stores the prompt's head: not in the count
        _add(g, f"burst-{tag}-warm", [f"Warm-up fact through {g.name}."])
    queue = "kvmem_encode_queue_depth"
    _until(lambda: all(_scraped(g.url, queue) == 0 for g in encoders), timeout=300,
           what="earlier tests' encodes settling")

    def counts() -> tuple[float, float]:
        return (sum(_scraped(r.url, "vllm:request_success_total") for r in replicas),
                sum(_scraped(g.url, "kvmem_fact_encodes_total") for g in encoders))

    before = counts()

    def write(i: int) -> list[str]:
        facts = [f"Burst {i}: my locker {j} holds {i * j} books." for j in range(3)]
        with _client(gateways[i % 2]) as c:
            r = c.post("/v1/memories", json={"user_id": f"burst-{tag}-{i}", "facts": facts,
                                              "encode": "sync" if i % 4 < 2 else "background"})
        assert r.status_code == 200, r.text
        return [m["id"] for m in r.json()["results"]]

    start = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        ids = [fact for batch in pool.map(write, range(16)) for fact in batch]
    with psycopg.connect(topology["db_url"], autocommit=True) as conn:
        _until(lambda: conn.execute("SELECT count(*) FROM facts WHERE id = ANY(%s) AND kv_status = 'encoded'",
                                    (ids,)).fetchone()[0] == len(ids), timeout=300, what="every burst fact encoded")
    burst_s = time.monotonic() - start

    def still() -> tuple[float, float] | None:
        # A second encode of a fact may still be on its way after the first stamped it: the
        # counts hold still past a background loop's wake-up (5 s).
        first = counts()
        time.sleep(6)
        return first if counts() == first else None

    settled = _until(still, timeout=120, what="the encode counts settling")
    replica_encodes, gateway_encodes = (a - b for a, b in zip(settled, before))
    print(f"\n{len(ids)} facts encoded in {burst_s:.1f} s: {replica_encodes:.0f} encodes finished by the replicas,"
          f" {gateway_encodes:.0f} sent")
    assert replica_encodes == len(ids) and gateway_encodes == len(ids)


def test_a_chat_goes_where_its_facts_kv_is_resident(topology, residency_gateway, tmp_path_factory):
    """Issue 54: a user's facts encoded and read on replica 1 (through a gateway that knows only
    it) while rendezvous hashing sends that user to replica 2. The residency gateway's next chat
    lands on replica 1, where the KV is in RAM; a rendezvous gateway's goes to replica 2. Counted
    by the replicas' own vLLM request counters."""
    import redis

    from kvmem.kv import residency

    (r1, r2), (a, _) = topology["replicas"], topology["gateways"]
    user = _user_on(r2, [r1, r2], "resident")
    facts = ["My sister Ines lives in Porto.", "Ines teaches the cello."]
    only_r1 = _start("gateway-r1", tmp_path_factory.mktemp("gateway-r1"),
                     ["gateway", "--replicas", r1.url, "--database-url", topology["db_url"]],
                     {"KVMEM_KV_SHARED_URL": topology["redis_url"]})
    try:
        _wait(only_r1, "/health")
        ids = _add(only_r1, user, facts)
        with _client(only_r1) as c:
            assert _chat(c, user, "Where does my sister live?", k=2).json()["memory"]["injected_tokens"] > 0
    finally:
        only_r1.stop()
    held = redis.Redis.from_url(topology["redis_url"])
    _until(lambda: residency.read(held, _fingerprint(), [r1.url, r2.url], ids).keys() == {r1.url},
           what="replica 1's summary holding the facts")
    with _client(residency_gateway) as c:
        _until(lambda: c.post("/v1/memories/search", json={"user_id": user, "query": "sister"}).json()["results"],
               what="the residency gateway finding the facts")

    def served(gateway: KvmemProcess) -> tuple[float, float]:
        before = [_scraped(r.url, "vllm:request_success_total") for r in (r1, r2)]
        with _client(gateway) as c:
            reply = _chat(c, user, "What does Ines teach?", k=2).json()
        assert sorted(reply["memory"]["fact_ids"]) == sorted(ids)
        return tuple(_scraped(r.url, "vllm:request_success_total") - b for r, b in zip((r1, r2), before))

    assert served(residency_gateway) == (1, 0)  # where the KV is
    assert served(a) == (0, 1)  # rendezvous: the user's hashed replica, which lacked it in RAM


def _routed(gateway: KvmemProcess) -> dict[str, float]:
    """replica URL -> 1 (routed to) or 0 (passed over), from the gateway's kvmem_replica_up."""
    lines = httpx.get(gateway.url + "/metrics", timeout=30).text.splitlines()
    return {line.split('replica="', 1)[1].split('"', 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in lines if line.startswith("kvmem_replica_up{")}


def _answered(gateway: KvmemProcess, replica: KvmemProcess) -> float:
    name = "kvmem_replica_requests_total{"
    return sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(gateway.url + "/metrics", timeout=30).text.splitlines()
               if line.startswith(name) and f'replica="{replica.url}"' in line)


def test_replicas_join_drain_and_lapse_without_restarting_a_gateway(topology, members_gateway, tmp_path_factory):
    """Issue 54: the members gateway follows the membership table. A replica started while it
    runs gets its users' chats; drained, it finishes the chat it has and gets no new one; killed
    (SIGKILL: no leave), it is out of the gateway's set within its lease."""
    from kvmem.engine.membership import LEASE_S, REFRESH_S, Registry

    replicas, gateway = topology["replicas"], members_gateway
    _until(lambda: set(_routed(gateway)) == {r.url for r in replicas}, timeout=30, what="the registered replicas")
    newcomer = _start("replica-3", tmp_path_factory.mktemp("replica-3"),
                      ["replica", "--database-url", topology["db_url"], "--drain-seconds", "0"],
                      {"KVMEM_KV_SHARED_URL": topology["redis_url"]})
    try:
        _wait(newcomer, "/v1/models")
        _until(lambda: _routed(gateway).get(newcomer.url) == 1, timeout=30, what="the new replica being routed to")
        user = _user_on(newcomer, [*replicas, newcomer], "joined")
        _add(gateway, user, ["My boat is called Petrel."])
        with _client(gateway) as c:
            assert _chat(c, user, "What is my boat called?").status_code == 200
        assert _answered(gateway, newcomer) > 0  # its users' chats go there, no gateway restarted

        # Drained with a chat in flight: that chat finishes there, the next goes elsewhere.
        with ThreadPoolExecutor(1) as pool, _client(gateway) as c:
            long = pool.submit(c.post, "/v1/chat/completions", json={
                "model": "kvmem", "messages": [{"role": "user", "content": "Tell me a long story about my boat."}],
                "max_tokens": 160, "logit_bias": {str(_eos()): -100}, "memory": {"user_id": user, "k": 1}})
            time.sleep(1.0)
            drain = subprocess.run([sys.executable, "-m", "kvmem.cli", "replica", "--drain", newcomer.url,
                                    "--database-url", topology["db_url"]], capture_output=True, text=True, timeout=60)
            assert drain.returncode == 0, drain.stderr
            _until(lambda: newcomer.url not in _routed(gateway), timeout=10, what="the drained replica leaving the set")
            assert long.result().status_code == 200
        time.sleep(2.5)  # /metrics reads a status cached for 2 s (STORE_TTL_S): it counts the long chat first
        before = _answered(gateway, newcomer)
        with _client(gateway) as c:
            assert _chat(c, user, "What is my boat called?").status_code == 200
        time.sleep(2.5)
        assert _answered(gateway, newcomer) == before

        # Back (as if restarted), then killed without leaving: out within its lease.
        Registry(topology["db_url"]).register(newcomer.url, _fingerprint(), lease_s=LEASE_S)
        _until(lambda: _routed(gateway).get(newcomer.url) == 1, timeout=10, what="the replica routed to again")
        newcomer.stop(signal.SIGKILL)
        killed = time.monotonic()
        _until(lambda: newcomer.url not in _routed(gateway), timeout=LEASE_S + REFRESH_S + 10,
               what="the killed replica's lease running out")
        print(f"\nkilled replica out of the gateway's set after {time.monotonic() - killed:.1f} s (lease {LEASE_S:.0f} s)")
    finally:
        newcomer.stop(signal.SIGKILL)


def _eos() -> int:
    from transformers import AutoTokenizer

    from kvmem.model import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(None, default_home() / "models").path).eos_token_id


def test_a_replica_sigkilled_under_load_loses_no_acknowledged_write(topology):
    import psycopg

    gateways, replicas = topology["gateways"], topology["replicas"]
    victim, survivor = replicas
    # Users served by the victim, with facts it encoded (so they exist only in its folder and Redis).
    # The last user is kept out of the load, so the survivor's prefix cache holds nothing of theirs.
    *users, spare = [_user_on(victim, replicas, f"load-{uuid.uuid4().hex[:4]}-{i}") for i in range(4)]
    for i, user in enumerate([*users, spare]):
        ids = _add(gateways[i % 2], user, [f"My favourite number is {40 + i}.", f"I was born in city number {i}."])
        # A blob is put in the shared tier first, then the replica's folder (kv/store.py), and an
        # encode is acknowledged once the shared tier has it: the local file may lag a moment.
        _until(lambda: all(_blob_files(victim, f) for f in ids), timeout=10, what="the victim's local blob files")
        assert not any(_blob_files(survivor, f) for f in ids)

    def chat(i: int) -> httpx.Response:
        with _client(gateways[i % 2]) as c:
            return _chat(c, users[i % len(users)], "What is my favourite number?", k=2)

    def add(i: int) -> tuple[httpx.Response, str]:
        text = f"Load fact {i}: I own {i} bicycles."
        with _client(gateways[i % 2]) as c:
            return c.post("/v1/memories", json={"user_id": users[i % len(users)], "facts": [text],
                                                "encode": "sync"}), text

    with ThreadPoolExecutor(8) as pool:  # bounded: 24 chats and 8 writes, 8 at a time
        chats = [pool.submit(chat, i) for i in range(24)]
        adds = [pool.submit(add, i) for i in range(8)]
        time.sleep(3)  # some requests are on the victim now
        victim.stop(signal.SIGKILL)
        chat_responses = [f.result() for f in chats]
        add_results = [f.result() for f in adds]

    for r in chat_responses:  # served (retried on the survivor) or refused clearly, never a 500
        assert r.status_code in (200, 503), r.text
        if r.status_code == 503:
            assert "replica" in r.text
    assert sum(r.status_code == 200 for r in chat_responses) >= len(chat_responses) // 2
    acknowledged = [(r.json()["results"][0]["id"], text) for r, text in add_results if r.status_code == 200]
    assert acknowledged  # writes go on: the fact store does not depend on the replicas
    with psycopg.connect(topology["db_url"]) as conn:
        for fact_id, text in acknowledged:
            row = conn.execute("SELECT text FROM facts WHERE id = %s", (fact_id,)).fetchone()
            assert row is not None and row[0] == text
    # The survivor now serves the victim's users from blobs it never encoded: pulled from Redis.
    with _client(gateways[1]) as c:
        after = _chat(c, spare, "What is my favourite number?", k=2).json()
    assert after["memory"]["injected_tokens"] > 0 and after["memory"]["fallbacks"] == 0, after
    assert all(_blob_files(survivor, f) for f in after["memory"]["fact_ids"])
    # The gateways count it: requests of the victim's users answered by the survivor, not their first choice.
    other = f'kvmem_replica_requests_total{{affinity="other",replica="{survivor.url}"}}'
    counted = [float(line.rsplit(" ", 1)[1]) for g in gateways
               for line in httpx.get(g.url + "/metrics", timeout=30).text.splitlines() if line.startswith(other)]
    assert counted and sum(counted) > 0

