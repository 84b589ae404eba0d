"""Bad input against the real server: one row per status of the error table, all in OpenAI's shape.

429 is in test_load.py (it needs a server with a small bound); 500 in test_unit.py (it needs a bug).
"""

from __future__ import annotations

import pytest

from tests.server.conftest import assert_error
from tests.server.serverproc import MAX_BODY

CHAT = {"model": "kvmem", "messages": [{"role": "user", "content": "hi"}], "user": "err-user", "max_tokens": 4}


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "tool", "content": "x"}]}, "messages"),  # answers no call
    ("/v1/chat/completions", {**CHAT, "messages": []}, "messages"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "n": 9}, "n"),  # over the server's max_n (8)
    ("/v1/chat/completions", {**CHAT, "stop": [""]}, "stop"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "retrieval"}]}, "tools"),  # only function tools
    ("/v1/chat/completions", {**CHAT, "memory": {"user_id": "u", "mode": "fast"}}, "memory.mode"),
    ("/v1/chat/completions", {**CHAT, "memory": {"user_id": "u", "text_facts": -1}}, "memory.text_facts"),
    ("/v1/chat/completions", {**CHAT, "user": ""}, "user"),
    ("/v1/memories", {"facts": ["x"]}, "user_id"),
    ("/v1/memories", {"user_id": "u", "facts": ["x"], "metadata": "not an object"}, "metadata"),
    ("/v1/memories", {"user_id": "u", "facts": ["   "]}, "facts"),
    ("/v1/memories", {"user_id": "u"}, "messages"),
    ("/v1/memories", {"user_id": "u", "facts": ["x"], "colour": "red"}, "colour"),
    ("/v1/memories", {"user_id": "u", "facts": ["x"], "timestamp": " "}, "timestamp"),
    ("/v1/memories", {"user_id": "u", "messages": [{"role": "user", "content": "x"}], "timestamp": "2023-05-09"},
     "timestamp"),
    ("/v1/memories/search", {"user_id": "u", "query": "q", "filters": {"topic": {"regex": "x"}}}, "filters"),
])
def test_400_names_the_field(alpha, path, body, param):
    assert_error(alpha.post(path, json=body), 400, param)


def test_400_for_a_body_that_is_not_json(alpha):
    r = alpha.post("/v1/memories", content=b"{not json", headers={"content-type": "application/json"})
    assert_error(r, 400)


def test_400_for_bad_query_parameters(alpha):
    assert_error(alpha.get("/v1/memories"), 400, "user_id")
    assert_error(alpha.get("/v1/memories", params={"user_id": "u", "limit": 0}), 400, "limit")


@pytest.mark.parametrize("auth", [None, "Bearer sk-not-a-key"])
def test_401_bad_or_missing_key(server, auth):
    with server.client(None) as c:
        r = c.get("/v1/models", headers={"Authorization": auth} if auth else {})
        assert assert_error(r, 401)["code"] == "invalid_api_key"
        assert_error(c.post("/v1/memories", json={"user_id": "u", "facts": ["x"]},
                            headers={"Authorization": auth} if auth else {}), 401)


def test_404_unknown_id_and_model(alpha):
    for method in ("get", "delete"):
        assert_error(getattr(alpha, method)("/v1/memories/f-doesnotexist"), 404)
    assert_error(alpha.get("/v1/memories/no/such/route"), 404)
    assert_error(alpha.post("/v1/chat/completions", json={**CHAT, "model": "gpt-17"}), 404, "model")


def test_413_oversize_body_and_fact(alpha):
    assert_error(alpha.post("/v1/memories", json={"user_id": "u", "facts": ["x" * MAX_BODY]}), 413)
    long_fact = " ".join(["word"] * 400)  # > memory.max_fact_tokens (256)
    assert_error(alpha.post("/v1/memories", json={"user_id": "u", "facts": [long_fact]}), 413)


def test_422_context_that_cannot_fit(alpha):
    too_long = {**CHAT, "messages": [{"role": "user", "content": "word " * 5000}]}
    assert assert_error(alpha.post("/v1/chat/completions", json=too_long), 422)["code"] == "context_length_exceeded"
    assert_error(alpha.post("/v1/chat/completions", json={**CHAT, "max_tokens": 10_000}), 422)
    assert_error(alpha.post("/v1/chat/completions", json={**CHAT, "max_tokens": 10_000, "stream": True}), 422)


def test_503_while_the_engine_loads(servers, server):
    first = servers.first
    for name in ("health", "chat"):
        assert assert_error(first.loading[name], 503)["code"] == "engine_loading"
