"""Fuzzing the chat endpoint's tool fields on the real server (hypothesis): random tool
definitions (valid, odd and broken JSON schemas), tool_choice values, assistant tool calls and
tool messages, in kv and text mode.

Properties: never a 5xx; a 4xx carries OpenAI's error body with a `param` naming one of the
fields at fault; a 200 with tool calls names only offered tools and, when forced, has arguments
that are JSON. Derandomized and bounded (KVMEM_FUZZ_EXAMPLES scales it); replies stay short.
"""

from __future__ import annotations

import json
import os

import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

EXAMPLES = max(1, int(30 * float(os.environ.get("KVMEM_FUZZ_EXAMPLES", "1"))))
PARAMS = {"tools", "tool_choice", "parallel_tool_calls", "messages"}
NAMES = ["get_weather", "save_note", "f"]

_json_scalar = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.text(max_size=6))
_schema_type = st.sampled_from(["object", "string", "integer", "number", "boolean", "array", "null", "nonsense", 3])
_property = st.fixed_dictionaries({"type": _schema_type}, optional={"enum": st.lists(_json_scalar, max_size=3),
                                                                    "maxLength": st.integers(-1, 8)})
_parameters = st.one_of(
    st.fixed_dictionaries({"type": st.just("object")},
                          optional={"properties": st.dictionaries(st.sampled_from(["a", "b", "city"]), _property,
                                                                  max_size=3),
                                    "required": st.lists(st.sampled_from(["a", "b", "city", "zz"]), max_size=3),
                                    "additionalProperties": st.booleans(), "$defs": st.one_of(st.just([]), st.just({}))}),
    st.dictionaries(st.text(max_size=5), _json_scalar, max_size=3),
    _json_scalar,
)
_function = st.fixed_dictionaries({"name": st.one_of(st.sampled_from(NAMES), st.text(max_size=8))},
                                  optional={"description": st.text(max_size=20), "parameters": _parameters,
                                            "strict": st.booleans()})
_tool = st.one_of(
    st.fixed_dictionaries({"type": st.just("function"), "function": _function}),
    st.fixed_dictionaries({"type": st.sampled_from(["retrieval", "code_interpreter", "", 1])}),
    _json_scalar,
)
_choice = st.one_of(st.none(), st.sampled_from(["none", "auto", "required", "always", ""]),
                    st.builds(lambda n: {"type": "function", "function": {"name": n}}, st.sampled_from(NAMES + ["x"])),
                    st.dictionaries(st.text(max_size=5), _json_scalar, max_size=2))
_call = st.fixed_dictionaries({"id": st.sampled_from(["c1", "c2"]), "type": st.just("function"),
                               "function": st.fixed_dictionaries({"name": st.sampled_from(NAMES),
                                                                  "arguments": st.sampled_from(["{}", '{"a": 1}', "{", "", "[]"])})})
_history = st.one_of(
    st.just([]),
    st.builds(lambda calls, answers: [{"role": "assistant", "content": None, "tool_calls": calls},
                                      *({"role": "tool", "tool_call_id": a, "content": "ok"} for a in answers)],
              st.lists(_call, min_size=1, max_size=2), st.lists(st.sampled_from(["c1", "c2", "c3"]), max_size=2)),
)


@pytest.fixture(scope="module")
def fuzz_user(servers) -> str:
    user = f"fuzz-tools-{uuid.uuid4().hex[:8]}"
    with servers.get().client("alpha") as c:
        r = c.post("/v1/memories", json={"user_id": user, "facts": ["I live in Galway."], "encode": "sync"})
    assert r.status_code == 200, r.text
    return user


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(tools=st.one_of(st.none(), st.lists(_tool, max_size=3)), choice=_choice, history=_history,
       parallel=st.one_of(st.none(), st.booleans()), mode=st.sampled_from(["kv", "text"]))
def test_tool_fields_never_5xx(server, fuzz_user, tools, choice, history, parallel, mode):
    body = {"model": "kvmem", "max_tokens": 8, "memory": {"user_id": fuzz_user, "k": 1, "mode": mode},
            "messages": [{"role": "user", "content": "Weather in Galway?"}, *history]}
    for key, value in (("tools", tools), ("tool_choice", choice), ("parallel_tool_calls", parallel)):
        if value is not None:
            body[key] = value
    with server.client("alpha") as c:
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code < 500, (r.status_code, r.text, body)
    if r.status_code >= 400:
        error = r.json()["error"]
        assert error["message"] and (error["param"] in PARAMS or error["param"].startswith("messages")), (error, body)
        return
    offered = {t["function"]["name"] for t in tools or () if isinstance(t, dict) and isinstance(t.get("function"), dict)}
    choice_out = r.json()["choices"][0]
    forced = choice == "required" or isinstance(choice, dict)
    for call in choice_out["message"].get("tool_calls") or ():
        assert call["function"]["name"] in offered, (choice_out, body)
        if forced and choice_out["finish_reason"] == "tool_calls":
            json.loads(call["function"]["arguments"])
