"""Schema-driven fuzzing of the real server: every operation of its OpenAPI schema (/openapi.json),
with data that fits the schema and data that does not (schemathesis).

Properties: never a 5xx; every 4xx carries OpenAI's JSON error body; a refused add stores
nothing. Generation is derandomized and bounded (KVMEM_FUZZ_EXAMPLES scales it), and chat
lengths are capped so a generated max_tokens of 4000 does not cost minutes of CPU.
"""

from __future__ import annotations

import json
import os

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from tests.server.serverproc import KEYS

EXAMPLES = max(1, int(25 * float(os.environ.get("KVMEM_FUZZ_EXAMPLES", "1"))))
AUTH = {"Authorization": f"Bearer {KEYS['alpha']}"}
MAX_NEW_TOKENS = 2

def _openapi() -> dict:
    """The server's schema, built from the app at collection time (no engine needed for it);
    test_the_schema_is_the_servers checks that the running server serves the same one."""
    from kvmem.server.app import create_app
    from kvmem.server.settings import ServerSettings

    return create_app(ServerSettings(api_keys={"k": "t"}), mem_factory=lambda: None).openapi()


SCHEMA = _openapi()
schema = schemathesis.openapi.from_dict(SCHEMA)
schema.config.generation.update(modes=["positive", "negative"], max_examples=EXAMPLES, deterministic=True,
                                database="none")


def test_the_schema_is_the_servers(server):
    import httpx

    assert httpx.get(server.url + "/openapi.json").json() == json.loads(json.dumps(SCHEMA))


def _steered(case, known_id: str) -> None:
    """Aim generated cases past the first check, so they reach the service and the engine: every
    chat names the served model (a random name is a 404 before anything else), half the fact-id
    paths name a stored fact, an add gives facts or messages, not both. Chats stay short and encodes in the background (the fuzz is about
    input, not speed)."""
    params = case.path_parameters or {}
    if isinstance(params.get("memory_id"), str) and len(params["memory_id"]) % 2 == 0:
        params["memory_id"] = known_id
    body = case.body if isinstance(case.body, dict) else None
    if body is None:
        return
    if case.path == "/v1/chat/completions":
        if isinstance(body.get("model"), str):
            body["model"] = "kvmem"
        for name in ("max_tokens", "max_completion_tokens"):
            value = body.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and MAX_NEW_TOKENS < value <= 4096:
                body[name] = MAX_NEW_TOKENS
        body.setdefault("max_tokens", MAX_NEW_TOKENS)
    if case.path == "/v1/memories" and case.method.upper() == "POST":
        if body.get("encode") == "sync":
            body["encode"] = "background"
        if body.get("messages") is not None and body.get("facts") is not None:
            del body["messages"]  # the schema allows both; the server wants one


@pytest.fixture
def known_id(alpha) -> str:
    r = alpha.post("/v1/memories", json={"user_id": "fuzz-known", "facts": ["The fuzzer's fact: owls hoot."]})
    assert r.status_code == 200, r.text
    return r.json()["results"][0]["id"]


def _stored(client, body) -> int | None:
    user = body.get("user_id") if isinstance(body, dict) else None
    if not isinstance(user, str):
        return None
    r = client.get("/v1/memories", params={"user_id": user})
    return r.json()["total"] if r.status_code == 200 else None


@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck))
def test_no_5xx_json_errors_nothing_stored_on_refusal(case, server, alpha, known_id):
    _steered(case, known_id)
    adding = case.method.upper() == "POST" and case.path == "/v1/memories"
    before = _stored(alpha, case.body) if adding else None
    response = case.call(base_url=server.url, headers=AUTH, timeout=180)
    status = response.status_code
    assert status < 500, f"{case.method} {case.path}: {status} {response.text[:500]}"
    if status >= 400:
        error = json.loads(response.text)["error"]
        assert isinstance(error["message"], str) and error["message"] and {"type", "param", "code"} <= set(error)
        if adding and before is not None:
            assert _stored(alpha, case.body) == before, "a refused add stored facts"
