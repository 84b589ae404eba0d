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

schema = schemathesis.pytest.from_fixture("api_schema")


@pytest.fixture
def api_schema(server):
    loaded = schemathesis.openapi.from_url(server.url + "/openapi.json")
    loaded.config.generation.update(modes=["positive", "negative"], max_examples=EXAMPLES, deterministic=True,
                                    database="none")
    return loaded


def _bounded(case) -> None:
    """Keep generated chats short and encodes in the background (the fuzz is about input, not speed)."""
    body = case.body if isinstance(case.body, dict) else None
    if body is None:
        return
    if case.path == "/v1/chat/completions":
        for name in ("max_tokens", "max_completion_tokens"):
            value = body.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and MAX_NEW_TOKENS < value <= 4096:
                body[name] = MAX_NEW_TOKENS
        body.setdefault("max_tokens", MAX_NEW_TOKENS)
    if case.path == "/v1/memories" and body.get("encode") == "sync":
        body["encode"] = "background"


def _stored(client, body) -> int | None:
    user = body.get("user_id") if isinstance(body, dict) else None
    if not isinstance(user, str):
        return None
    r = client.get("/v1/memories", params={"user_id": user})
    return r.json()["total"] if r.status_code == 200 else None


@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck))
def test_no_5xx_json_errors_nothing_stored_on_refusal(case, server, alpha):
    _bounded(case)
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
