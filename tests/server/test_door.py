"""The door (issue 53): every field of every route, sent what its type is not, is a 400 that names
it, never a 5xx and never coerced. Integers beyond int64, negatives, floats for integers, strings
for integers and booleans, numbers past float's range, non-strings for strings.

No engine: the server runs a KVMem without one (start_engine=False), so everything up to the
engine is real (pydantic at the edge, the hand checks of the Mem0 routes, the service's own) and
a chat that passes the door ends in 503 engine_unavailable, which is what "accepted" means here.
The JSON routes' fields are read from their pydantic models, so a field added there is tested
here; the Mem0 routes take free bodies checked by hand, so their fields are listed.
"""

from __future__ import annotations

import json
import types
import typing
from typing import Any, Literal

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from kvmem.config import Config
from kvmem.server.app import create_app
from kvmem.server.routes_memory import AddMemoriesBody
from kvmem.server.schemas import ChatRequest, SearchMemories, UpdateMemory
from kvmem.server.settings import ServerSettings
from kvmem.service import KVMem
from tests.server.conftest import assert_error

KEY = "sk-door"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"model": "kvmem", "messages": [{"role": "user", "content": "hi"}], "user": "door", "max_tokens": 2}
KNOWN = "{known}"  # replaced by a stored fact's id
EXAMPLES = settings(max_examples=25, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))

# -- what is sent ---------------------------------------------------------------------------------

BEYOND_INT64 = st.one_of(st.integers(min_value=2**63), st.integers(max_value=-(2**63) - 1))
PAST_FLOAT = st.one_of(st.integers(min_value=10**309), st.integers(max_value=-(10**309)))
NOT_INT = st.one_of(BEYOND_INT64, st.floats(), st.integers().map(str), st.booleans(), st.just("2"))
NOT_BOOL = st.one_of(st.text(max_size=5), st.sampled_from(["yes", "true", "1", ""]), st.integers(), st.floats())
NOT_FLOAT = st.one_of(PAST_FLOAT, st.booleans(), st.text(max_size=5), st.just("1"))
NOT_STR = st.one_of(st.integers(), BEYOND_INT64, st.booleans(), st.floats(allow_nan=False))
BAD = {"int": NOT_INT, "bool": NOT_BOOL, "float": NOT_FLOAT, "str": NOT_STR}
NEGATIVE = st.integers(max_value=-1)  # valid for a few fields (seed, top_k -1): accepted, or a 400 naming it


# -- the fields of the JSON routes, from their models ----------------------------------------------

def _kind(annotation) -> str | None:
    """The scalar kind a field takes ("int", "bool", "float", "str"), or None for a container."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        kinds = {_kind(a) for a in args}
        return kinds.pop() if len(kinds) == 1 else ("str" if "str" in kinds else None)
    if origin is typing.Annotated:
        return _kind(args[0])
    if origin is Literal:
        return "str"
    return {int: "int", bool: "bool", float: "float", str: "str"}.get(annotation)


def _model_fields(model: type[BaseModel], prefix: str = "") -> list[tuple[str, str]]:
    """(path, kind) of every scalar field, with those of nested models and of a list's first item."""
    out = []
    for name, info in model.model_fields.items():
        ann = info.annotation
        members = typing.get_args(ann) if typing.get_origin(ann) in (typing.Union, types.UnionType) else (ann,)
        lists = [typing.get_args(a)[0] for a in members if typing.get_origin(a) is list]
        item = lists[0] if lists else None
        if any(map(_is_model, members)):
            out += _model_fields(next(a for a in members if _is_model(a)), f"{prefix}{name}.")
        elif _kind(ann) is not None:
            out.append((f"{prefix}{name}", _kind(ann)))
        if _is_model(item):  # a list of objects (messages): its first one's fields
            out += _model_fields(item, f"{prefix}{name}[0].")
        elif item is not None and _kind(item) is not None:
            out.append((f"{prefix}{name}[0]", _kind(item)))
    return out


def _is_model(annotation) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


JSON_ROUTES = [  # method, path, a body the door lets through, its model
    ("POST", "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                                      "memory": {"user_id": "door"}, "stream_options": {}}, ChatRequest),
    ("POST", "/v1/memories", {"user_id": "door", "messages": [{"role": "user", "content": "Door turn."}]},
     AddMemoriesBody),
    ("POST", "/v1/memories/search", {"user_id": "door", "query": "q"}, SearchMemories),
    ("PUT", "/v1/memories/{memory_id}", {"text": "Door fact, updated."}, UpdateMemory),
]

# The Mem0 routes' free bodies (routes_mem0.py checks them by hand): their fields, listed.
MEM0_ROUTES = [
    ("POST", "/v3/memories/add/", {"messages": [{"role": "user", "content": "hi"}], "user_id": "door"},
     [("infer", "bool"), ("timestamp", "float"), ("user_id", "str"), ("agent_id", "str"), ("run_id", "str"),
      ("expiration_date", "str")]),
    ("POST", "/v3/memories/search/", {"query": "q", "filters": {"user_id": "door"}},
     [("top_k", "int"), ("threshold", "float"), ("query", "str"), ("filters.user_id", "str")]),
    ("POST", "/v3/memories/", {"filters": {"user_id": "door"}}, [("filters.user_id", "str")]),
    ("PUT", "/v1/memories/{memory_id}/", {"text": "Door fact, by Mem0."}, [("text", "str"), ("expiration_date", "str")]),
    ("PUT", "/v1/batch/", {"memories": [{"memory_id": KNOWN, "text": "t"}]},
     [("memories[0].memory_id", "str"), ("memories[0].text", "str")]),
    ("DELETE", "/v1/batch/", {"memories": [{"memory_id": KNOWN}]}, [("memories[0].memory_id", "str")]),
]

# Query strings arrive as text by nature: their integers are bounded and must be whole numbers.
QUERY_INTS = [("GET", "/v1/memories", {"user_id": "door"}, "limit"), ("GET", "/v1/memories", {"user_id": "door"}, "offset"),
              ("POST", "/v3/memories/", {}, "page"), ("POST", "/v3/memories/", {}, "page_size")]

# Routes whose only input is a path id or nothing: no field to send a wrong type in. /ui's forms
# are text by nature (its one number, the page offset, is tested below).
NO_FIELDS = {"/health", "/metrics", "/v1/models", "/v1/ping/", "/v1/entities/", "/v1/memories/{memory_id}",
             "/v1/memories/{memory_id}/", "/v1/memories/{memory_id}/history", "/v1/memories/{memory_id}/history/",
             "/v1/chats/{chat_id}/trace", "/v2/entities/{kind}/{name}/", "/v1/memories/", "/v1/memories/search/"}

CASES = [(m, p, body, path, kind) for m, p, body, model in JSON_ROUTES for path, kind in _model_fields(model)]
CASES += [(m, p, body, path, kind) for m, p, body, fields in MEM0_ROUTES for path, kind in fields]


def _with(body: dict, path: str, value: Any) -> dict:
    """A deep copy of `body` with the field at `path` ("memory.k", "memories[0].text") set."""
    out = json.loads(json.dumps(body))
    keys = [int(k) if k.isdigit() else k for k in path.replace("[", ".").replace("]", "").split(".")]
    node = out
    for key, after in zip(keys, keys[1:]):
        if isinstance(key, int):
            node = node[key]
        else:  # a container the base body lacks (or holds a string in): a list for "[0]", else an object
            container = list if isinstance(after, int) else dict
            if not isinstance(node.get(key), container):
                node[key] = [{}] if container is list else {}
            node = node[key]
    node[keys[-1]] = value
    return out


@pytest.fixture(scope="module")
def door(tmp_path_factory, model_dir):
    home = tmp_path_factory.mktemp("door")
    config = Config(home=home / "home", models_home=model_dir.parent)
    app = create_app(ServerSettings(api_keys={KEY: "t"}), config, mem_factory=lambda: KVMem(config, start_engine=False))
    with TestClient(app, headers=AUTH) as c:
        assert app.state.runtime.loaded.wait(120) and app.state.runtime.mem is not None, app.state.runtime.error
        r = c.post("/v1/memories", json={"user_id": "door", "facts": ["The door's own fact."], "encode": "background"})
        c.known = r.json()["results"][0]["id"]
        yield c


def _send(door, method: str, path: str, body: dict | None = None, params: dict | None = None):
    content = json.dumps(body).replace(KNOWN, door.known) if body is not None else None
    return door.request(method, path.replace("{memory_id}", door.known), params=params, content=content,
                        headers={"content-type": "application/json"})


def _names(error: dict, path: str) -> bool:
    param = error["param"] or ""
    return param == path or param.startswith((f"{path}.", f"{path}["))


def _refused(r, path: str) -> None:
    assert r.status_code == 400, f"{path}: {r.status_code} {r.text[:300]}"
    error = assert_error(r, 400)
    assert _names(error, path) and error["code"], f"{path}: {error}"


def _accepted(r) -> bool:
    """Past the door: a 2xx, or a chat that reached the missing engine."""
    return r.status_code < 300 or (r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable")


@pytest.mark.parametrize("method,route,body,path,kind", CASES, ids=[f"{c[1]}:{c[3]}" for c in CASES])
def test_a_wrong_type_is_a_400_naming_the_field(door, method, route, body, path, kind):
    @EXAMPLES
    @given(BAD[kind])
    def check(value):
        _refused(_send(door, method, route, _with(body, path, value)), path)

    check()


@pytest.mark.parametrize("method,route,body,path,kind", [c for c in CASES if c[4] in ("int", "float")],
                         ids=[f"{c[1]}:{c[3]}" for c in CASES if c[4] in ("int", "float")])
def test_a_negative_number_is_taken_or_a_400_naming_the_field(door, method, route, body, path, kind):
    @EXAMPLES
    @given(NEGATIVE)
    def check(value):
        r = _send(door, method, route, _with(body, path, value))
        assert _accepted(r) or r.status_code == 400 and _names(r.json()["error"], path), f"{path}: {r.text[:300]}"

    check()


@pytest.mark.parametrize("method,route,params,name", QUERY_INTS, ids=[f"{q[1]}:{q[3]}" for q in QUERY_INTS])
def test_a_query_integer_is_bounded_and_whole(door, method, route, params, name):
    @EXAMPLES
    @given(st.one_of(BEYOND_INT64.map(str), st.integers(max_value=-1).map(str), st.floats().map(str),
                     st.sampled_from(["true", "1e3", "0x10", "9" * 5000])))  # "": FastAPI reads it as absent
    def check(value):
        body = {"filters": {"user_id": "door"}} if method == "POST" else None
        _refused(_send(door, method, route, body, params={**params, name: value}), name)

    check()


@pytest.mark.parametrize("bias", [{"²": 1}, {"9" * 5000: 1}, {str(2**63): 1}, {"-1": 1}, {"1.5": 1}, {"5": 10**400},
                                  {"5": "1"}, {"5": True}, {"5": 101}, {str(2**31): 1}])
def test_logit_bias_keys_and_values_are_bounded(door, bias):
    _refused(_send(door, "POST", "/v1/chat/completions", {**CHAT, "logit_bias": bias}), "logit_bias")


@pytest.mark.parametrize("field,value", [("seed", 2**64), ("seed", 2**63), ("stream", "yes"), ("n", 1.5),
                                         ("max_tokens", "2"), ("top_logprobs", 21), ("n", 2**70)])
def test_the_issues_chat_cases_are_400s(door, field, value):
    _refused(_send(door, "POST", "/v1/chat/completions", {**CHAT, field: value}), field)


def test_the_int64_ends_pass_the_door(door):
    for seed in (2**63 - 1, -(2**63)):
        assert _accepted(_send(door, "POST", "/v1/chat/completions", {**CHAT, "seed": seed, "temperature": 1}))


def test_a_string_window_is_a_400(door):
    body = {"user_id": "door", "messages": [{"role": "user", "content": "x"}], "window": "2"}
    _refused(_send(door, "POST", "/v1/memories", body), "window")


@pytest.mark.parametrize("method,route,body", [
    ("POST", "/v1/memories", {"user_id": "door", "facts": ["Door expiry."]}),
    ("PUT", "/v1/memories/{memory_id}", {"text": "Door fact, expiring."}),
    ("POST", "/v3/memories/add/", {"user_id": "door", "messages": "Door expiry, by Mem0."}),
    ("PUT", "/v1/memories/{memory_id}/", {"text": "Door fact, expiring by Mem0."}),
])
def test_an_expiry_past_what_a_date_can_hold_is_a_400(door, method, route, body):
    for instant in ("0001-01-01T00:00:00+01:00", "9999-12-31T23:59:59-23:59"):  # years 0 and 10000, UTC
        _refused(_send(door, method, route, {**body, "expiration_date": instant}), "expiration_date")
    r = _send(door, method, route, {**body, "expiration_date": "9999-12-31"})
    assert r.status_code == 200, r.text
    assert "9999-12-31T23:59:59+00:00" in r.text


@pytest.mark.parametrize("header", ["Bearer  " + KEY, "Token  " + KEY, "Bearer", "bearer \t" + KEY])
def test_a_malformed_authorization_header_is_a_400(door, header):
    r = door.get("/v1/models", headers={"Authorization": header})
    assert_error(r, 400, "authorization")
    assert "invalid_request" in r.headers["www-authenticate"]


def test_one_space_and_either_scheme_is_how_a_key_is_sent(door):
    for header in (f"Bearer {KEY}", f"bearer {KEY}", f"Token {KEY}"):
        assert door.get("/v1/models", headers={"Authorization": header}).status_code == 200
    assert_error(door.get("/v1/models", headers={"Authorization": f"Basic {KEY}"}), 401)


@pytest.mark.parametrize("offset", [str(2**63), "9" * 5000, "-1", "1.5", "x"])
def test_the_ui_page_offset_is_bounded(door, offset):
    r = door.get("/ui/scope", params={"user": "door", "offset": offset})
    assert r.status_code == 400 and "offset" in r.text, r.text[:300]


def test_every_route_with_fields_is_covered(door):
    covered = {p for _, p, _, _ in JSON_ROUTES} | {p for _, p, _, _ in MEM0_ROUTES} | {q[1] for q in QUERY_INTS}
    routes = {r.path for r in door.app.routes if isinstance(r, APIRoute) and not r.path.startswith("/ui")}
    docs = {"/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}
    assert routes - covered - NO_FIELDS - docs == set(), "a route whose fields test_door.py does not send"


def test_a_chat_the_engine_cannot_serve_is_a_503_that_says_when_to_retry(door):
    """engine_unavailable came without Retry-After, unlike the other documented 503s (issue 53)."""
    r = door.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    assert r.headers["retry-after"].isdigit() and int(r.headers["retry-after"]) > 0


def test_tool_calls_on_a_user_message_are_a_400_not_a_500(door):
    """Found by the schema fuzzer (tests/server/test_fuzz.py): a user message with tool_calls [{}]
    passed the checks, which read tool calls of assistant messages only, and the chat template
    then failed on it (KeyError 'function': a 500 once an engine serves)."""
    body = {**CHAT, "messages": [{"role": "user", "content": None, "tool_calls": [{}]}]}
    _refused(door.post("/v1/chat/completions", json=body), "messages")
