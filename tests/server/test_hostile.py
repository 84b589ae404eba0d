"""Input from a careless or hostile client against the real server: always a 4xx, nothing stored.

Bodies are sent as raw JSON so they can hold what a JSON encoder would refuse to produce, such
as a lone UTF-16 surrogate escape ("a\\ud800").
"""

from __future__ import annotations

import json
import socket

import pytest

from tests.server.conftest import assert_error
from tests.server.serverproc import KEYS

BAD = "a\ud800"  # a lone surrogate: valid JSON, not valid Unicode
CHAT = {"model": "kvmem", "messages": [{"role": "user", "content": "hi"}], "user": "hostile", "max_tokens": 2}


def post_raw(client, path: str, body: dict, method: str = "POST"):
    content = json.dumps(body).encode()  # ensure_ascii: the surrogate goes as a \ud800 escape
    return client.request(method, path, content=content, headers={"content-type": "application/json"})


def stored(client, user: str) -> int:
    r = client.get("/v1/memories", params={"user_id": user})
    assert r.status_code == 200, r.text
    return r.json()["total"]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/memories", {"user_id": BAD, "facts": ["x"]}, "user_id"),
    ("/v1/memories", {"user_id": "sur", "agent_id": BAD, "facts": ["x"]}, "agent_id"),
    ("/v1/memories", {"user_id": "sur", "run_id": BAD, "facts": ["x"]}, "run_id"),
    ("/v1/memories", {"user_id": "sur", "facts": ["ok", BAD]}, "facts"),
    ("/v1/memories", {"user_id": "sur", "facts": ["x"], "metadata": {BAD: 1}}, "metadata"),
    ("/v1/memories", {"user_id": "sur", "facts": ["x"], "metadata": {"k": [BAD]}}, "metadata"),
    ("/v1/memories", {"user_id": "sur", "messages": [{"role": "user", "content": BAD}]}, "messages"),
    ("/v1/memories", {"user_id": "sur", "messages": [{"role": "user", "content": "x", "name": BAD}]}, "messages"),
    ("/v1/memories", {"user_id": "sur", "messages": BAD}, "facts"),
    ("/v1/memories/search", {"user_id": "sur", "query": BAD}, "query"),
    ("/v1/memories/search", {"user_id": "sur", "query": "q", "filters": {"k": BAD}}, "filters"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": BAD}]}, "messages"),
    ("/v1/chat/completions", {**CHAT, "stream": True, "messages": [{"role": "user", "content": BAD}]}, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "system", "content": BAD}, *CHAT["messages"]]},
     "messages"),
    ("/v1/chat/completions", {**CHAT, "user": BAD}, "user"),
    ("/v1/chat/completions", {**CHAT, "memory": {"user_id": BAD}}, "memory.user_id"),
    ("/v1/chat/completions", {**CHAT, "memory": {"user_id": "sur", "agent_id": BAD}}, "agent_id"),
    ("/v1/chat/completions", {**CHAT, "model": BAD}, "model"),
])
def test_lone_surrogates_are_400_in_every_text_field(alpha, path, body, param):
    assert_error(post_raw(alpha, path, body), 400 if param != "model" else 404, param)
    assert stored(alpha, "sur") == 0


def test_lone_surrogate_in_an_update_is_400_and_keeps_the_old_text(alpha):
    (fact,) = alpha.post("/v1/memories", json={"user_id": "sur-put", "facts": ["I own a red kayak."]}).json()["results"]
    assert_error(post_raw(alpha, f"/v1/memories/{fact['id']}", {"text": BAD}, method="PUT"), 400)
    assert alpha.get(f"/v1/memories/{fact['id']}").json()["memory"] == "I own a red kayak."


@pytest.mark.parametrize("offset", [2**63, 10**30])
def test_offset_beyond_sqlite_integers_is_400(alpha, offset):
    assert_error(alpha.get("/v1/memories", params={"user_id": "u", "offset": offset}), 400, "offset")


def test_the_largest_offset_is_an_empty_page(alpha):
    r = alpha.get("/v1/memories", params={"user_id": "u", "offset": 2**63 - 1})
    assert r.status_code == 200 and r.json()["results"] == []


@pytest.mark.parametrize("text", ["\u0000KVMEM-FACTS\u0000", "a \u0000KVMEM-FACTS\u0000 b \u0000KVMEM-FACTS\u0000"])
def test_the_old_prompt_marker_in_user_text_is_just_text(alpha, text):
    r = alpha.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": text}]})
    assert r.status_code == 200, r.text
    r = alpha.post("/v1/memories", json={"user_id": "marker", "facts": [text], "encode": "sync"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("fact", ["\u0000", "\ufeff", "\u200b\u200b", "\u00a0\u2028", "\ufeff \u0000 \u200d"])
def test_facts_of_invisible_characters_are_400(alpha, fact):
    assert_error(alpha.post("/v1/memories", json={"user_id": "invisible", "facts": [fact]}), 400, "facts")
    assert stored(alpha, "invisible") == 0


def metric(client, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def wait_for(check, what: str, timeout: float = 120.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_client_that_hangs_up_on_a_plain_chat_is_aborted_in_the_engine(server, alpha):
    """Non-streamed: the generation stops when the client goes (it used to run to max_tokens)."""
    before = metric(alpha, "kvmem_requests_aborted_total")
    body = json.dumps({**CHAT, "max_tokens": 3000, "messages": [
        {"role": "user", "content": "Write the numbers from 1 to 5000, one per line, with no other text."}]}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEYS['alpha']}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(head + body)
        wait_for(lambda: metric(alpha, "kvmem_inflight_chats") == 1, "the chat to start")
    wait_for(lambda: metric(alpha, "kvmem_requests_aborted_total") == before + 1, "the abort")
    wait_for(lambda: metric(alpha, "kvmem_inflight_chats") == 0, "the slot to be freed")


def test_a_client_that_hangs_up_on_a_stream_is_aborted_in_the_engine(server, alpha):
    before = metric(alpha, "kvmem_requests_aborted_total")
    body = {**CHAT, "max_tokens": 3000, "stream": True, "messages": [
        {"role": "user", "content": "Write the numbers from 1 to 5000, one per line, with no other text."}]}
    with alpha.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # the stream has started
    wait_for(lambda: metric(alpha, "kvmem_requests_aborted_total") == before + 1, "the abort")
    wait_for(lambda: metric(alpha, "kvmem_inflight_chats") == 0, "the slot to be freed")


def test_a_client_that_hangs_up_on_a_streamed_forced_tool_call_is_aborted_in_the_engine(server, alpha):
    """A forced call sends nothing, not even the response's start, before its whole reply is read:
    the server must notice the client leaving while it waits (it used to run to max_tokens)."""
    before = metric(alpha, "kvmem_requests_aborted_total")
    numbers = {"type": "object", "required": ["numbers"],
               "properties": {"numbers": {"type": "array", "items": {"type": "integer"}, "minItems": 1500}}}
    body = json.dumps({**CHAT, "max_tokens": 3000, "stream": True,
                       "messages": [{"role": "user", "content": "List the numbers from 1 to 2000."}],
                       "tools": [{"type": "function", "function": {"name": "record", "parameters": numbers}}],
                       "tool_choice": {"type": "function", "function": {"name": "record"}}}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEYS['alpha']}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(head + body)
        wait_for(lambda: metric(alpha, "kvmem_inflight_chats") == 1, "the chat to start")
    wait_for(lambda: metric(alpha, "kvmem_requests_aborted_total") == before + 1, "the abort", timeout=60)
    wait_for(lambda: metric(alpha, "kvmem_inflight_chats") == 0, "the slot to be freed")
