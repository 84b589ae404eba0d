"""The server without an engine: settings, keys, error mapping, 500s with a request id, 503, 413."""

from __future__ import annotations

import logging
import threading
import time

import pytest
from fastapi.testclient import TestClient

from kvmem.errors import InvalidInputError
from kvmem.index import validate_filters
from kvmem.server.app import create_app
from kvmem.server.cli import serve_main
from kvmem.server.errors import from_invalid_input, validation_param
from kvmem.server.runtime import Gate
from kvmem.server.settings import ServerSettings, SettingsError, load, parse_keys
from kvmem.server.tenants import KeyRing, Tenant
from tests.server.conftest import assert_error

CHAT = {"model": "kvmem", "messages": [{"role": "user", "content": "hi"}], "user": "u"}


class FakeMem:
    def chat(self, messages, **kw):
        raise RuntimeError("boom: an unexpected bug")

    def close(self):
        pass


def client(factory=FakeMem, **settings) -> TestClient:
    app = create_app(ServerSettings(api_keys={"k1": "t1"}, **settings), mem_factory=factory)
    return TestClient(app, headers={"Authorization": "Bearer k1"})


def wait_loaded(c: TestClient) -> None:
    runtime = c.app.state.runtime
    assert runtime.loaded.wait(30) and runtime.mem is not None, runtime.error


def test_unexpected_error_is_500_with_request_id_in_log(caplog):
    with client() as c, caplog.at_level(logging.ERROR, logger="kvmem.server"):
        wait_loaded(c)
        r = c.post("/v1/chat/completions", json=CHAT)
    error = assert_error(r, 500)
    rid = error["request_id"]
    assert rid in error["message"] and r.headers["x-request-id"] == rid
    assert any(rid in rec.getMessage() and rec.exc_info for rec in caplog.records)
    assert "boom" not in r.text  # internals stay in the log


def test_503_while_loading_then_ready():
    release = threading.Event()

    def slow():
        release.wait(10)
        return FakeMem()

    with client(slow) as c:
        for path, method in (("/health", "get"), ("/v1/chat/completions", "post"), ("/v1/memories?user_id=u", "get")):
            r = getattr(c, method)(path, **({"json": CHAT} if method == "post" else {}))
            assert assert_error(r, 503)["code"] == "engine_loading"
        release.set()
        wait_loaded(c)
        assert c.get("/health").status_code == 200


def test_engine_failure_is_reported_and_stops_the_server():
    stopped = threading.Event()

    def broken():
        raise RuntimeError("no model here")

    app = create_app(ServerSettings(), mem_factory=broken, on_engine_failure=stopped.set)
    with TestClient(app) as c:
        assert stopped.wait(5)
        assert "no model here" in assert_error(c.get("/health"), 503)["message"]


@pytest.mark.parametrize("auth", [None, "Bearer wrong", "Basic k1", "k1"])
def test_bad_or_missing_key_is_401(auth):
    with client() as c:
        headers = {"Authorization": auth} if auth else {}
        c.headers.pop("Authorization")
        assert assert_error(c.get("/v1/models", headers=headers), 401)["code"] == "invalid_api_key"


def test_oversize_body_is_413_by_length_and_by_count():
    with client(max_body_bytes=1000) as c:
        assert_error(c.post("/v1/memories", content=b"x" * 2000), 413)

        def chunks():  # no Content-Length: counted as it arrives
            yield b"x" * 600
            yield b"x" * 600

        assert_error(c.post("/v1/memories", content=chunks()), 413)


STATUS = {InvalidInputError.INVALID_VALUE: 400, InvalidInputError.FACT_TOO_LARGE: 413,
          InvalidInputError.CONTEXT_LENGTH_EXCEEDED: 422}
# Each old status's trigger words (the server once chose the status by matching them), and
# plain text: none of it may move the status away from the code's.
WORDINGS = ["fact is 300 tokens long; the limit is 256 (memory.max_fact_tokens)",
            "fact and its context do not fit the model's context length",
            "prompt of 5000 tokens + 64 new tokens exceeds the model's 4096",
            "user_id must be a non-empty string, got ''", "something is wrong"]


@pytest.mark.parametrize("code", InvalidInputError.CODES)
def test_invalid_input_status_and_param_come_from_the_code_whatever_the_message(code):
    for message in WORDINGS:
        error = from_invalid_input(InvalidInputError(message, param="facts[0]", code=code))
        assert (error.status, error.param, error.code, error.message) == (STATUS[code], "facts[0]", code, message)


def test_invalid_input_param_is_the_errors_own_unless_the_caller_names_one():
    assert from_invalid_input(InvalidInputError("user_id must be set")).param is None  # no guessing from words
    assert from_invalid_input(InvalidInputError("x", param="query")).param == "query"
    assert from_invalid_input(InvalidInputError("x", param="query"), param="messages").param == "messages"
    too_big = InvalidInputError("x", code=InvalidInputError.FACT_TOO_LARGE)
    assert from_invalid_input(too_big, param="facts").status == 413


@pytest.mark.parametrize("value", ["the limit is 256", "far too long", "exceeds the model", "do not fit"])
def test_a_real_refusal_keeps_its_status_and_param_whatever_its_message_says(value):
    """validate_filters quotes the bad value in its message, so the text reads like a 413 or
    a 422 there; status and param are still those set where it is raised."""
    with pytest.raises(InvalidInputError) as raised:
        validate_filters({"when": {"gt": value}})
    assert any(word in str(raised.value) for word in ("limit is", "too long", "exceed", "do not fit"))
    error = from_invalid_input(raised.value)
    assert (error.status, error.param, error.code) == (400, "filters", "invalid_value")
    reworded = InvalidInputError("a new wording", param=raised.value.param, code=raised.value.code)
    assert (from_invalid_input(reworded).status, from_invalid_input(reworded).param) == (400, "filters")


def test_validation_param_names_the_field():
    assert validation_param(("body", "messages", 0, "role")) == "messages[0].role"
    assert validation_param(("query", "limit")) == "limit"
    assert validation_param(("body", "messages", "str")) == "messages"
    assert validation_param(("body", "messages", "list[MemoryMessage]", 0, "role")) == "messages[0].role"


def test_gate_refuses_above_its_bound():
    gate = Gate(2)
    assert gate.enter() and gate.enter() and not gate.enter()
    gate.leave()
    assert gate.enter()


def test_tenants_namespace_and_refuse_the_separator():
    alpha = Tenant("alpha")
    assert alpha.user_id("bob") == "alpha::bob" and alpha.local("alpha::bob") == "bob"
    assert alpha.owns("alpha::bob") and not alpha.owns("beta::bob") and not alpha.owns("alphabet::bob")
    with pytest.raises(Exception) as e:
        alpha.user_id("beta::bob")
    assert e.value.status == 400
    assert Tenant(None).user_id("bob") == "bob" and not Tenant(None).owns("alpha::bob")
    ring = KeyRing({"sk-1": "alpha"})
    assert ring.tenant("Bearer sk-1") == alpha and KeyRing({}).tenant(None) == Tenant(None)


def test_keys_from_file_and_environment(tmp_path):
    cfg = tmp_path / "s.toml"
    cfg.write_text('[server]\nmax_body_bytes = 7\n[tenants]\nacme = ["k1", "k2"]\n[memory]\nwindow = 3\n')
    settings, config = load(cfg, {"KVMEM_API_KEYS": "globex=k3", "KVMEM_SERVER_MAX_INFLIGHT": "5"},
                            {"data_dir": tmp_path / "d", "port": 9000})
    assert settings.api_keys == {"k1": "acme", "k2": "acme", "k3": "globex"}
    assert (settings.max_inflight, settings.max_body_bytes, settings.port) == (5, 7, 9000)
    assert config.memory.window == 3
    assert config.home == tmp_path / "d"
    with pytest.raises(SettingsError):
        parse_keys({"a": "same"}, "b=same")  # one key, two tenants
    with pytest.raises(SettingsError):
        parse_keys({"a::b": "k"}, "")
    cfg.write_text("[server]\nmax_inflihgt = 3\n")
    with pytest.raises(SettingsError, match="max_inflihgt"):
        load(cfg, {}, {})


@pytest.fixture
def cli_env(monkeypatch):
    """serve_main sets these with setdefault; set here, monkeypatch restores them after the test."""
    monkeypatch.delenv("KVMEM_API_KEYS", raising=False)
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "WARNING")
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def test_public_address_without_keys_needs_the_flag(cli_env, capsys):
    assert serve_main(["--host", "0.0.0.0", "--port", "1"]) == 2
    assert "--allow-public-without-keys" in capsys.readouterr().err


class AnsweringMem:
    """No chat_stream: the server streams the whole answer as one delta."""

    def chat(self, messages, **kw):
        from kvmem.results import ChatResult

        if "x" * 10 in messages[-1]["content"]:
            raise InvalidInputError("prompt of 9999 tokens + 4 new tokens exceeds the model's 4096",
                                    code=InvalidInputError.CONTEXT_LENGTH_EXCEEDED)  # as KVMem.chat raises it
        return ChatResult(answer="Bruno.", mode=kw["mode"], fact_ids=("f-1",), ttft_s=0.01, latency_s=0.02,
                          prompt_tokens=50, injected_tokens=30, cached_tokens=0, fallbacks=0, token_ids=(1, 2))

    def close(self):
        pass


def test_streaming_without_chat_stream_sends_one_delta_and_releases_the_slot():
    with client(AnsweringMem) as c:
        wait_loaded(c)
        r = c.post("/v1/chat/completions", json={**CHAT, "stream": True, "stream_options": {"include_usage": True}})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        import json

        chunks = [json.loads(e) for e in events[:-1]]
        assert "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks if ch["choices"]) == "Bruno."
        assert chunks[-2]["memory"]["fact_ids"] == ["f-1"] and chunks[-1]["usage"]["injected_tokens"] == 30
        too_long = {**CHAT, "stream": True, "messages": [{"role": "user", "content": "x" * 20}]}
        assert_error(c.post("/v1/chat/completions", json=too_long), 422)  # before the stream starts
        assert c.app.state.runtime.gate.count == 0


def test_open_server_says_so_at_start(cli_env, monkeypatch, caplog):
    import kvmem.server.cli as cli

    monkeypatch.setattr(cli, "_run", lambda settings, config: 0)
    with caplog.at_level(logging.WARNING, logger="kvmem.server"):
        assert serve_main(["--port", "8123"]) == 0
    assert any("OPEN" in r.getMessage() and "loopback only" in r.getMessage() for r in caplog.records)


class BlockingMem:
    """Each add blocks until `release` is set: a server whose thread pool is full."""

    def __init__(self) -> None:
        from kvmem.results import MemoryStatus

        self.release, self.entered, self._lock = threading.Event(), 0, threading.Lock()
        tiers = dict.fromkeys(("ram_budget_bytes", "disk_bytes", "disk_hits", "disk_misses", "ram_hits",
                               "ram_misses", "evictions", "readmissions"), 0)
        self.status = lambda: MemoryStatus(facts=0, encode_queue=0, kv_bytes=0,
                                           tiers={**tiers, "disk_budget_bytes": None}, engine=None)

    def add(self, *args, **kw):
        from kvmem.results import AddResult

        with self._lock:
            self.entered += 1
        self.release.wait(60)
        return AddResult((), 0, 0, None)

    def close(self):
        self.release.set()


def test_metrics_answer_while_every_pool_thread_is_busy():
    """/metrics used to queue behind the KVMem calls (4.4 s under 200 concurrent adds)."""
    mem = BlockingMem()
    with client(lambda: mem, max_inflight=1) as c:
        wait_loaded(c)
        threads = c.app.state.settings.max_inflight + 32  # the pool's size (app.py)
        adds = [threading.Thread(target=c.post, args=("/v1/memories",), kwargs={"json": {"user_id": "u", "facts": ["x"]}})
                for _ in range(threads + 8)]
        for t in adds:
            t.start()
        deadline = time.monotonic() + 60
        while mem.entered < threads:  # every pool thread now waits in add()
            assert time.monotonic() < deadline, f"only {mem.entered} adds started"
            time.sleep(0.01)
        scrape = {}
        scraper = threading.Thread(target=lambda: scrape.setdefault("r", c.get("/metrics")))
        scraper.start()
        scraper.join(30)
        answered = "r" in scrape
        mem.release.set()
        for t in (*adds, scraper):
            t.join(60)
        assert answered, "/metrics waited for the busy pool"
        assert scrape["r"].status_code == 200 and "kvmem_inflight_chats" in scrape["r"].text


@pytest.mark.parametrize("docs", [True, False])
def test_api_docs_are_public_unless_turned_off(docs):
    with client(docs=docs) as c:
        c.headers.pop("Authorization")
        for path in ("/openapi.json", "/docs", "/redoc"):
            assert c.get(path).status_code == (200 if docs else 404), path
        assert_error(c.get("/v1/models"), 401)  # the API itself still needs a key
