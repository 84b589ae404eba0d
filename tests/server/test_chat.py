"""The official `openai` client against a real server: chat with memory, streaming and not."""

from __future__ import annotations

FACTS = ["My sister Marta adopted a puppy called Bruno.", "I live in Porto and work on tram signalling.",
         "My favourite food is grilled sardines.", "I paint watercolours at the weekend."]
QUESTION = "What is the name of my sister's puppy?"


def _store(alpha, user: str) -> list[str]:
    r = alpha.post("/v1/memories", json={"user_id": user, "facts": FACTS, "encode": "sync"})
    assert r.status_code == 200, r.text
    return [m["id"] for m in r.json()["results"]]


def _search_ids(alpha, user: str, k: int) -> set[str]:
    r = alpha.post("/v1/memories/search", json={"user_id": user, "query": QUESTION, "limit": k})
    return {m["id"] for m in r.json()["results"]}


def test_models_list(openai_client):
    ids = [m.id for m in openai_client.models.list()]
    assert "kvmem" in ids and len(ids) >= 1


def test_chat_with_memory_uses_the_searched_facts(openai_client, alpha):
    _store(alpha, "chat-user")
    r = openai_client.chat.completions.create(model="kvmem", messages=[{"role": "user", "content": QUESTION}],
                                              user="chat-user", max_tokens=24)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length")
    memory = r.model_extra["memory"]
    assert set(memory["fact_ids"]) == _search_ids(alpha, "chat-user", 5)  # default k=5 (order: prompt order)
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0
    assert r.usage.model_extra["injected_tokens"] == memory["injected_tokens"] >= 0
    assert memory["mode"] == "kv"


def test_memory_object_sets_scope_k_and_mode(openai_client, alpha):
    _store(alpha, "chat-user-2")
    r = openai_client.chat.completions.create(
        model="kvmem", messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}],
        max_tokens=16, extra_body={"memory": {"user_id": "chat-user-2", "k": 2, "mode": "text"}})
    memory = r.model_extra["memory"]
    assert memory["mode"] == "text" and memory["injected_tokens"] == 0
    assert set(memory["fact_ids"]) == _search_ids(alpha, "chat-user-2", 2)
    off = openai_client.chat.completions.create(model="kvmem", messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=4)
    assert off.model_extra["memory"]["fact_ids"] == [] and off.model_extra["memory"]["mode"] == "off"


def test_streaming_chat(openai_client, alpha):
    _store(alpha, "chat-user-3")
    stream = openai_client.chat.completions.create(
        model="kvmem", messages=[{"role": "user", "content": QUESTION}], user="chat-user-3", max_tokens=24,
        stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()
    final = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(final) == 1 and final[0].choices[0].finish_reason in ("stop", "length")
    assert set(final[0].model_extra["memory"]["fact_ids"]) == _search_ids(alpha, "chat-user-3", 5)
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens > 0 and "injected_tokens" in usage.model_extra


def test_metrics_after_chats(server, openai_client):
    openai_client.chat.completions.create(model="kvmem", messages=[{"role": "user", "content": "Hello"}],
                                          user="metrics-user", max_tokens=2)
    import httpx

    text = httpx.get(server.url + "/metrics").text
    for name in ("kvmem_chat_ttft_seconds_bucket{", 'mode="kv"', "kvmem_injected_tokens_total",
                 "kvmem_fallbacks_total", "kvmem_encode_queue_depth", "kvmem_kv_store_bytes", "kvmem_facts ",
                 'kvmem_kv_tier_hits_total{tier="disk"}', 'kvmem_kv_tier_misses_total{tier="ram"}',
                 'kvmem_kv_tier_budget_bytes{tier="ram"}', "kvmem_kv_evictions_total", "kvmem_kv_readmissions_total"):
        assert name in text, name


def test_memory_text_facts_prefills_the_last_facts_as_text(openai_client, alpha):
    def injected(text_facts: int, stream: bool = False) -> int:
        user = f"chat-user-text-facts-{text_facts}"  # a user each: no prefix-cache hit on another call's KV
        _store(alpha, user)
        memory = {"user_id": user, "k": 2, "mode": "kv", "text_facts": text_facts}
        r = openai_client.chat.completions.create(model="kvmem", messages=[{"role": "user", "content": QUESTION}],
                                                  max_tokens=4, stream=stream, extra_body={"memory": memory})
        final = [c for c in r if c.choices and c.choices[0].finish_reason][0] if stream else r
        assert final.model_extra["memory"]["mode"] == "kv" and len(final.model_extra["memory"]["fact_ids"]) == 2
        return final.model_extra["memory"]["injected_tokens"]

    # Each fact taken out of the plan lowers the count; the system header stays injected.
    assert injected(0) > injected(1) > injected(2, stream=True) > 0


def test_memory_fidelity_names_a_point_per_chat(openai_client, alpha):
    """memory.fidelity (kv/fidelity.py) through the SDK: "exact" recomputes every fact token the
    chat injects, "fast" none; an unknown point is a 400 naming the field."""
    import openai
    import pytest

    def recomputed(point: str) -> int:
        user = f"chat-user-fidelity-{point}"
        _store(alpha, user)
        memory = {"user_id": user, "k": 2, "mode": "kv", "fidelity": point}
        r = openai_client.chat.completions.create(model="kvmem", messages=[{"role": "user", "content": QUESTION}],
                                                  max_tokens=2, extra_body={"memory": memory})
        assert r.model_extra["memory"]["injected_tokens"] > 0
        return r.model_extra["memory"]["recomputed_tokens"]

    assert recomputed("fast") == 0 and recomputed("exact") > 0
    with pytest.raises(openai.BadRequestError) as e:
        recomputed("perfect")
    assert e.value.body["param"] == "memory.fidelity"


def test_auto_mode_through_the_sdk_serves_text_until_the_model_is_verified(openai_client, alpha, servers):
    """memory.mode "auto" as the openai SDK sends it (extra_body): text with no `kvmem verify`
    verdict for the served model, KV once one passed; the reply names the mode served."""
    from kvmem.model import resolve_model, verdict

    _store(alpha, "chat-auto")
    fingerprint = resolve_model(None, servers.data_dir / "models").fingerprint
    path = verdict.verdict_path(servers.data_dir, fingerprint)
    path.unlink(missing_ok=True)

    def ask() -> dict:
        r = openai_client.chat.completions.create(model="kvmem", messages=[{"role": "user", "content": QUESTION}],
                                                  max_tokens=4, extra_body={"memory": {"user_id": "chat-auto",
                                                                                       "mode": "auto"}})
        return r.model_extra["memory"]

    try:
        unverified = ask()
        assert unverified["mode"] == "text" and unverified["injected_tokens"] == 0
        verdict.save(servers.data_dir, fingerprint, {"passed": True})
        verified = ask()
        assert verified["mode"] == "kv" and verified["injected_tokens"] > 0
    finally:
        path.unlink(missing_ok=True)
