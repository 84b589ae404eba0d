"""Two tenants, the same user id: no memory endpoint or chat lets one see or touch the other's facts."""

from __future__ import annotations

import pytest

from tests.server.conftest import assert_error

USER = "bob"  # the same local user id in both tenants


@pytest.fixture
def facts(alpha, beta):
    alpha.delete("/v1/memories", params={"user_id": USER})
    beta.delete("/v1/memories", params={"user_id": USER})
    a = alpha.post("/v1/memories", json={"user_id": USER, "facts": ["Bob's secret code is 4711 (alpha)."],
                                         "encode": "sync"}).json()["results"]
    b = beta.post("/v1/memories", json={"user_id": USER, "facts": ["Bob's bicycle is red (beta)."],
                                        "encode": "sync"}).json()["results"]
    return a[0]["id"], b[0]["id"]


def test_lists_and_searches_stay_inside_the_tenant(facts, beta):
    a_id, b_id = facts
    listed = beta.get("/v1/memories", params={"user_id": USER}).json()
    assert [m["id"] for m in listed["results"]] == [b_id] and listed["total"] == 1
    assert listed["results"][0]["user_id"] == USER  # the tenant prefix is never shown
    hits = beta.post("/v1/memories/search", json={"user_id": USER, "query": "What is Bob's secret code?"}).json()
    assert [m["id"] for m in hits["results"]] == [b_id]


@pytest.mark.parametrize("method,path,body", [
    ("get", "/v1/memories/{id}", None),
    ("put", "/v1/memories/{id}", {"text": "Overwritten by beta."}),
    ("delete", "/v1/memories/{id}", None),
    ("get", "/v1/memories/{id}/history", None),
])
def test_foreign_ids_answer_404_like_unknown_ones(facts, alpha, beta, method, path, body):
    a_id, _ = facts
    kw = {"json": body} if body else {}
    foreign = getattr(beta, method)(path.format(id=a_id), **kw)
    unknown = getattr(beta, method)(path.format(id="f-" + "0" * 32), **kw)
    assert_error(foreign, 404)
    assert foreign.json() == unknown.json()
    assert alpha.get(f"/v1/memories/{a_id}").json()["memory"] == "Bob's secret code is 4711 (alpha)."


def test_delete_scope_and_separator(facts, alpha, beta):
    a_id, _ = facts
    assert beta.delete("/v1/memories", params={"user_id": USER}).json()["deleted"] == 1
    assert alpha.get(f"/v1/memories/{a_id}").status_code == 200
    for user in ("alpha::bob", "::bob"):
        assert_error(beta.get("/v1/memories", params={"user_id": user}), 400, "user_id")
        assert_error(beta.post("/v1/memories", json={"user_id": user, "facts": ["x"]}), 400, "user_id")


def test_chat_never_injects_another_tenants_facts(facts, server):
    a_id, b_id = facts
    from openai import OpenAI

    from tests.server.serverproc import KEYS

    beta = OpenAI(base_url=server.url + "/v1", api_key=KEYS["beta"], max_retries=0, timeout=180)
    for mode in ("kv", "text"):
        r = beta.chat.completions.create(model="kvmem", messages=[{"role": "user", "content": "What is my code?"}],
                                         max_tokens=8, extra_body={"memory": {"user_id": USER, "mode": mode}})
        assert r.model_extra["memory"]["fact_ids"] == [b_id]
        assert "4711" not in r.choices[0].message.content
    with pytest.raises(Exception) as e:
        beta.chat.completions.create(model="kvmem", messages=[{"role": "user", "content": "hi"}], user="alpha::bob")
    assert e.value.status_code == 400
