"""A stock vLLM OpenAI server started by `kvmem replica`, and the service talking to it over HTTP.

The replica is vLLM's own API server process with kvmem's connector named in
--kv-transfer-config; the service in this process runs no vLLM (RemoteEngine). Oracle: a fact
encoded through the replica and injected through it gives the first token's logprobs of text
prefill of the same prompt (k=1, injected where encoded: exact).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import httpx
import pytest

from kvmem.bench.oracle import logprob_gap
from kvmem.config import Config, KVConfig, default_home
from kvmem.engine import replica
from kvmem.engine.protocol import EngineRequest
from kvmem.errors import EngineError
from kvmem.model import resolve_model
from kvmem.reader import adapters, lora

START_S = 600  # a cold CPU start imports vLLM and loads the model: ~1 minute here, more on CI


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(config with engine.url set, the replica's process): one replica for the module.

    The replica serves the bundled model's shipped reader adapter (KVMEM_READER_ADAPTER unset:
    auto); the services here read without it (reader_adapter off) unless a test asks for it."""
    home = tmp_path_factory.mktemp("replica-home")
    port = _free_port()
    config = Config(home=home, models_home=default_home() / "models", kv=KVConfig(reader_adapter="off"))
    # A small share of host memory: the suite's in-process engine may be running beside it.
    config = dataclasses.replace(config, engine=dataclasses.replace(config.engine, gpu_memory_utilization=0.1))
    env = {**os.environ, "KVMEM_GPU_MEMORY_UTILIZATION": "0.1", "KVMEM_HOME": str(home)}
    env.pop("KVMEM_READER_ADAPTER", None)
    log = (home / "replica.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "kvmem.cli", "--home", str(home), "--models-home",
                             str(config.models_dir), "replica", "--port", str(port)],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the replica exited with {proc.returncode}: {(home / 'replica.log').read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(2)
    else:
        pytest.fail("the replica did not start in time")
    yield dataclasses.replace(config, engine=dataclasses.replace(config.engine, url=url)), proc
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    log.close()


@pytest.fixture(scope="module")
def remote_mem(served):
    from kvmem.service import KVMem

    config, _ = served
    with KVMem(config, background=False) as mem:
        yield mem


def test_the_printed_command_is_the_stock_server_with_kvmem_s_connector(tmp_path):
    config = Config(home=tmp_path, models_home=default_home() / "models")
    model = resolve_model(None, config.models_dir)
    cmd = replica.command(config, model, port=8123)
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] and "--port" in cmd and "8123" in cmd
    transfer = replica.transfer_config(config, model)
    assert cmd[cmd.index("--kv-transfer-config") + 1].count(model.fingerprint) == 1
    assert transfer["kv_connector_module_path"] == "kvmem.connector.connector"
    assert transfer["kv_connector_extra_config"]["kv_dir"] == str(tmp_path / "kv")


def test_facts_encoded_and_injected_through_the_replica_match_text_prefill(remote_mem):
    from kvmem.engine.protocol import Engine
    from kvmem.engine.remote import RemoteEngine

    assert isinstance(remote_mem.engine, RemoteEngine) and isinstance(remote_mem.engine, Engine)
    user = f"u-{uuid.uuid4().hex[:8]}"  # a salt no earlier prompt used: nothing comes from the prefix cache
    added = remote_mem.add(facts=["My dog is called Biscuit and loves carrots.", "I live in Porto."], user_id=user)
    assert added.encode.encoded == 2 and all(remote_mem.kv.get(i).num_tokens > 0 for i in added.ids)
    ids = [added.ids[0]]
    kv = remote_mem.chat("What is my dog called?", user_id=user, fact_ids=ids, mode="kv", max_tokens=4, logprobs=5)
    text = remote_mem.chat("What is my dog called?", user_id=user, fact_ids=ids, mode="text", max_tokens=4, logprobs=5)
    again = remote_mem.chat("What is my dog called?", user_id=user, fact_ids=ids, mode="text", max_tokens=4,
                            logprobs=5)  # the engine's own prefix-cache hit on the same prompt
    assert kv.injected_tokens > 0 and kv.fallbacks == 0  # the replica's connector loaded our blobs
    assert_as_exact_as_a_cache_hit(text, kv, again)


def assert_as_exact_as_a_cache_hit(text, kv, again, exact: float = 1e-3) -> None:
    """KV equals text prefill to within the engine's own prefix-cache noise. Where a cache hit
    is bit-exact (most hosts) that is `exact` and the same greedy tokens; on hosts whose kernels
    differ between fresh and cached prefill (seen: AMX-bf16 Xeons, gaps of 0.07-0.12 for vLLM's
    own cache hits) injection may differ by as much again."""
    noise = logprob_gap(text.first_logprobs, again.first_logprobs)
    gap = logprob_gap(text.first_logprobs, kv.first_logprobs)
    assert gap <= 2 * noise + exact, f"injection deviates {gap:.4f}; the engine's own cache hit {noise:.4f}"
    if noise <= exact:
        assert kv.token_ids == text.token_ids and kv.answer == text.answer


def test_a_streamed_chat_through_the_replica_sends_text_then_the_result(remote_mem):
    user = f"u-{uuid.uuid4().hex[:8]}"
    remote_mem.add(facts=["I paint watercolours of old buildings."], user_id=user)
    pieces = list(remote_mem.chat_stream("What do I paint?", user_id=user, mode="kv", max_tokens=6))
    texts, result = [p for p in pieces if isinstance(p, str)], pieces[-1]
    assert texts and "".join(texts).strip() == result.answer and 0 < len(result.token_ids) <= 6


def test_a_replica_of_other_weights_is_refused(served, remote_mem):
    from kvmem.engine.remote import RemoteEngine

    config, _ = served
    other = dataclasses.replace(remote_mem.model, fingerprint="0" * 64)
    with pytest.raises(EngineError, match="not kvmem-0000"):
        RemoteEngine(config.engine.url, other, remote_mem.kv)


def test_scoring_through_a_replica_is_refused_clearly(remote_mem):
    with pytest.raises(EngineError, match="in-process engine"):
        remote_mem.engine.run([EngineRequest((1, 2, 3), "s", 1, score_last=1)])


def test_a_dead_replica_is_passed_over_and_its_users_served_by_the_next(served, remote_mem, monkeypatch):
    """A replica that refuses connections (as a SIGKILLed one does): every request still
    completes on the live one; with no replica left the error says so."""
    from kvmem.engine import health
    from kvmem.engine.remote import RemoteEngine, rendezvous

    config, _ = served
    dead = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    # No probe: this test is about what requests alone find out (tests/engine/test_health.py probes).
    engine = RemoteEngine([dead, config.engine.url], remote_mem.model, remote_mem.kv, probe_s=None)
    try:
        users = [u for u in (f"user-{i}" for i in range(50)) if rendezvous(u, [dead, config.engine.url])[0] == dead][:3]
        assert users  # some users' first choice is the dead replica
        assert engine.route(users[0])[0] == config.engine.url  # found down at start: passed over
        prompt = tuple(remote_mem.prompts.context_tokens("Hello there"))
        monkeypatch.setattr(health, "DOWN_S", 0.0)  # as if it had been down long ago: tried first again
        engine.replicas.mark_up(dead)
        results = engine.run([EngineRequest(prompt, f"salt-{u}", 2, route=u) for u in users])
        assert all(len(r.token_ids) == 2 for r in results) and engine.failovers == len(users)
        status = engine.status()  # what /metrics reads: per replica, first choice or not
        assert status.kind == "remote" and status.healthy and status.failovers == len(users)
        assert sum(n for url, first, n in status.answered if url == config.engine.url and not first) == len(users)
    finally:
        engine.close()
    with pytest.raises(EngineError, match="no kvmem replica answers"):
        RemoteEngine([dead], remote_mem.model, remote_mem.kv)


def test_kv_chats_through_the_replica_read_with_its_reader_adapter_text_chats_never(served, remote_mem):
    from kvmem.service import KVMem

    config, _ = served
    user = f"u-{uuid.uuid4().hex[:8]}"
    question = "What is my dog called?"
    with KVMem(dataclasses.replace(config, kv=KVConfig(reader_adapter="auto")), background=False) as mem:
        shipped = adapters.find("auto", config.home, mem.model.fingerprint)
        # A LoRA is served as a LoRA module; a KV map alone is applied by the replica's connector.
        assert mem.engine.reader_adapter == (replica.reader_name(mem.model) if lora.has_lora(shipped) else None)
        ids = list(mem.add(facts=["My dog is called Biscuit and loves carrots."], user_id=user).ids)
        read = mem.chat(question, user_id=user, fact_ids=ids, mode="kv", max_tokens=2, logprobs=5)
        text = mem.chat(question, user_id=user, fact_ids=ids, mode="text", max_tokens=2, logprobs=5)
        again = mem.chat(question, user_id=user, fact_ids=ids, mode="text", max_tokens=2, logprobs=5)
    plain = remote_mem.chat(question, user_id=user, fact_ids=ids, mode="kv", max_tokens=2, logprobs=5)
    assert read.reader_adapter and not text.reader_adapter and not plain.reader_adapter
    assert remote_mem.engine.reader_adapter is None  # reader_adapter off: never asked for
    # The replica read the KV chat alone with its adapter: plain KV matches text, the read one moves.
    assert_as_exact_as_a_cache_hit(text, plain, again)
    assert read.first_logprobs != plain.first_logprobs


def test_sampling_n_logprobs_and_json_reach_the_replica(remote_mem):
    """Seeded sampling with n choices, top logprobs, streaming per choice and a JSON schema,
    through a replica's completions API (RemoteEngine)."""
    from kvmem.engine.sampling import Sampling
    from kvmem.errors import InvalidInputError

    user, q = f"u-{uuid.uuid4().hex[:8]}", "Describe my dog."
    seeded = Sampling(temperature=1.0, seed=11, n=2)
    first, again = (remote_mem.chat(q, user_id=user, mode="off", max_tokens=6, sampling=seeded, logprobs=3)
                    for _ in range(2))
    assert len(first.choices) == 2 and [c.token_ids for c in first.choices] == [c.token_ids for c in again.choices]
    step = first.choices[1].logprobs[0]
    assert step.token_id == first.choices[1].token_ids[0] and step.logprob <= 0 and len(step.top) == 3
    assert [lp for _, lp in step.top] == sorted((lp for _, lp in step.top), reverse=True)
    streamed = list(remote_mem.chat_stream(q, user_id=user, mode="off", max_tokens=6, sampling=seeded))
    result = streamed[-1]
    assert [c.token_ids for c in result.choices] == [c.token_ids for c in first.choices]
    for c in result.choices:  # each choice's deltas add up to its text
        assert "".join(d.text for d in streamed[:-1] if d.index == c.index).strip() == c.answer
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"],
              "additionalProperties": False}
    reply = remote_mem.chat("My dog is Rex. Reply in JSON with his name.", user_id=user, mode="off", max_tokens=40,
                            sampling=Sampling(json_schema=schema))
    assert reply.finish_reason == "stop" and set(json.loads(reply.answer)) == {"name"}
    with pytest.raises(InvalidInputError) as refused:
        remote_mem.chat(q, user_id=user, mode="off", max_tokens=4, sampling=Sampling(json_schema={"type": "nonsense"}))
    assert refused.value.param == "response_format"
