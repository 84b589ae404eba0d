"""The chat x-ray over HTTP: GET /v1/chats/{id}/trace and its metrics, on the real server."""

from __future__ import annotations

import json
import uuid

import pytest

FACTS = ["My dog is called Biscuit.", "I live in Galway.", "My sister plays the cello."]


@pytest.fixture(scope="module")
def user(servers) -> str:
    user = f"trace-{uuid.uuid4().hex[:8]}"
    with servers.get().client("alpha") as c:
        r = c.post("/v1/memories", json={"user_id": user, "facts": FACTS, "encode": "sync"})
    assert r.status_code == 200, r.text
    return user


def _chat(client, user: str, mode: str, **memory) -> dict:
    r = client.post("/v1/chat/completions", json={
        "model": "kvmem", "max_tokens": 4, "messages": [{"role": "user", "content": "What is my dog called?"}],
        "memory": {"user_id": user, "k": 3, "mode": mode, **memory}})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_kv_chat_shows_each_fact_and_how_it_went_in(alpha, user):
    reply = _chat(alpha, user, "kv", text_facts=1)
    trace = alpha.get(f"/v1/chats/{reply['id']}/trace").json()
    assert trace["id"] == reply["id"] and trace["user_id"] == user and trace["mode"] == "kv"
    assert [f["id"] for f in trace["facts"]] == reply["memory"]["fact_ids"]
    assert [(f["served"], f["reason"]) for f in trace["facts"]] == [("kv", None), ("kv", None), ("text", "text_facts")]
    assert all(isinstance(f["score"], float) and f["tokens"] > 0 for f in trace["facts"])
    assert {f["text"] for f in trace["facts"]} == set(FACTS)
    assert trace["prefill_tokens_saved"] == reply["usage"]["injected_tokens"] > 0
    assert trace["prompt_tokens"] == reply["usage"]["prompt_tokens"] and trace["ttft_ms"] > 0
    assert trace["question"] == "What is my dog called?" and trace["fallbacks"] == {"text_facts": 1}


def test_a_text_chat_prefills_every_fact(alpha, user):
    trace = alpha.get(f"/v1/chats/{_chat(alpha, user, 'text')['id']}/trace").json()
    assert {(f["served"], f["reason"]) for f in trace["facts"]} == {("text", "mode")}
    assert trace["prefill_tokens_saved"] == 0


def test_a_streamed_chat_is_traced_under_its_chunks_id(alpha, user):
    with alpha.stream("POST", "/v1/chat/completions", json={
            "model": "kvmem", "max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": "Hi"}],
            "memory": {"user_id": user, "k": 2}}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    trace = alpha.get(f"/v1/chats/{chunks[0]['id']}/trace")
    assert trace.status_code == 200 and len(trace.json()["facts"]) == 2


def test_another_tenant_or_an_unknown_chat_is_404(alpha, beta, user):
    chat_id = _chat(alpha, user, "kv")["id"]
    assert beta.get(f"/v1/chats/{chat_id}/trace").status_code == 404
    assert alpha.get("/v1/chats/chatcmpl-nope/trace").status_code == 404


def test_metrics_count_saved_prefill_and_text_facts(alpha, server, user):
    _chat(alpha, user, "kv", text_facts=1)
    text = alpha.get("/metrics").text
    saved = [line for line in text.splitlines() if line.startswith('kvmem_prefill_tokens_saved_total{scope="user"}')]
    assert saved and float(saved[0].split()[-1]) > 0, text[:2000]
    assert 'kvmem_fallback_facts_total{reason="text_facts"}' in text
