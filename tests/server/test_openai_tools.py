"""Tool calling on `POST /v1/chat/completions`, through the official openai client, kv and text.

- `tool_choice` a named function or "required": the reply is constrained by the calls' JSON
  schema (vLLM's structured outputs), so even the bundled 135M model returns calls whose
  arguments validate against the tool's schema; finish_reason "tool_calls", content None;
- a tool round trip (assistant tool call, tool result, final answer) answers in text;
- "auto" and "none" answer in text when the model calls nothing; streamed calls arrive as
  OpenAI's tool_call deltas and equal the unstreamed ones;
- KV mode and text mode read the same tokens for a tools prompt: equal calls at k=1, greedy;
- bad tool input is a 400 naming its field.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import jsonschema
import openai
import pytest
from openai import AsyncOpenAI
from pydantic import BaseModel

from tests.server.conftest import assert_error
from tests.server.serverproc import KEYS

MODES = ["kv", "text"]
FACTS = ["I live in Galway and work as a ferry mechanic.", "My dog is called Biscuit and loves carrots."]
QUESTION = "What is the weather like where I live?"
GALWAY = "What is the weather in Galway today, in celsius?"
WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": WEATHER_PARAMS}}
NOTE_PARAMS = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
NOTE = {"type": "function", "function": {"name": "save_note", "description": "Save a note for the user",
                                         "parameters": NOTE_PARAMS}}
SCHEMAS = {"get_weather": WEATHER_PARAMS, "save_note": NOTE_PARAMS}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
CHAT = {"model": "kvmem", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


class Weather(BaseModel):
    city: str
    unit: str


def _store(servers, facts: list[str]) -> str:
    user = f"tools-{uuid.uuid4().hex[:8]}"
    with servers.get().client("alpha") as c:
        r = c.post("/v1/memories", json={"user_id": user, "facts": facts, "encode": "sync"})
    assert r.status_code == 200, r.text
    return user


@pytest.fixture(scope="module")
def user(servers) -> str:
    return _store(servers, FACTS)


@pytest.fixture(scope="module")
def one_fact_user(servers) -> str:
    return _store(servers, FACTS[:1])


def _kw(user: str, mode: str, messages: list | None = None, *, k: int = 2, **fields) -> dict:
    fields.setdefault("max_tokens", 48)
    return {"model": "kvmem", "messages": messages or [{"role": "user", "content": QUESTION}],
            "extra_body": {"memory": {"user_id": user, "k": k, "mode": mode}}, **fields}


def _check_calls(choice, *, one: bool = False) -> list:
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls and (len(calls) == 1 or not one), choice.message
    assert choice.message.content is None, choice.message
    for call in calls:
        assert call.type == "function" and call.id, call
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return calls


def _collect_stream(stream) -> tuple[str, dict[int, dict], list[str]]:
    """Streamed chunks -> content, tool calls by their index (deltas joined), finish reasons."""
    content, calls, finishes = "", {}, []
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or ():
                call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = d.id or call["id"]
                call["name"] += (d.function.name or "") if d.function else ""
                call["arguments"] += (d.function.arguments or "") if d.function else ""
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
    return content, calls, finishes


# -- forced calls ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_a_named_function_returns_arguments_that_validate(openai_client, user, mode):
    r = openai_client.chat.completions.create(**_kw(user, mode, tools=[WEATHER, NOTE], tool_choice=NAMED))
    (call,) = _check_calls(r.choices[0], one=True)
    assert call.function.name == "get_weather"
    assert r.model_extra["memory"]["mode"] == mode
    assert (r.model_extra["memory"]["injected_tokens"] > 0) == (mode == "kv")


@pytest.mark.parametrize("mode", MODES)
def test_required_calls_only_the_given_tools(openai_client, user, mode):
    r = openai_client.chat.completions.create(**_kw(user, mode, tools=[WEATHER, NOTE], tool_choice="required",
                                                    parallel_tool_calls=False, max_tokens=64))
    (call,) = _check_calls(r.choices[0], one=True)
    assert call.function.name in SCHEMAS


@pytest.mark.parametrize("mode", MODES)
def test_parse_with_a_pydantic_function_tool(openai_client, user, mode):
    tool = openai.pydantic_function_tool(Weather, name="get_weather")
    r = openai_client.chat.completions.parse(**_kw(user, mode, tools=[tool], tool_choice=NAMED))
    call = r.choices[0].message.tool_calls[0]
    assert isinstance(call.function.parsed_arguments, Weather), call


def test_kv_calls_equal_text_calls_for_one_fact(openai_client, one_fact_user):
    """k=1 greedy: the fact sits where it was encoded, and the tools render in the tail either way."""
    # A question whose call is clear-cut: on hosts where vLLM's own prefix-cache hits move logprobs
    # by ~0.1 (AMX CPUs, see docs/benchmarks.md), a near tie in an invented city name could flip.
    kw = dict(k=1, tools=[WEATHER, NOTE], tool_choice="required", temperature=0, max_tokens=160)
    question = [{"role": "user", "content": GALWAY}]
    kv = openai_client.chat.completions.create(**_kw(one_fact_user, "kv", question, **kw))
    text = openai_client.chat.completions.create(**_kw(one_fact_user, "text", question, **kw))
    assert kv.model_extra["memory"]["injected_tokens"] > 0 == text.model_extra["memory"]["injected_tokens"]
    assert kv.usage.prompt_tokens == text.usage.prompt_tokens
    kv_calls, text_calls = _check_calls(kv.choices[0]), _check_calls(text.choices[0])
    assert [(c.function.name, c.function.arguments) for c in kv_calls] == \
        [(c.function.name, c.function.arguments) for c in text_calls]


# -- streaming ------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("choice", [NAMED, "required"], ids=["named", "required"])
def test_streamed_calls_equal_the_unstreamed_ones(openai_client, user, choice, mode):
    kw = _kw(user, mode, [{"role": "user", "content": GALWAY}], tools=[WEATHER, NOTE], tool_choice=choice,
             max_tokens=160)
    whole = openai_client.chat.completions.create(**kw)
    _check_calls(whole.choices[0])
    content, calls, finishes = _collect_stream(openai_client.chat.completions.create(**kw, stream=True))
    expected = [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
    assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == expected
    assert all(c["id"] for c in calls.values()) and content == "" and finishes == ["tool_calls"]


def test_auto_streams_text_when_the_model_calls_nothing(openai_client, user):
    """'auto' with a question no tool fits: whatever the model does, stream and whole agree."""
    kw = _kw(user, "kv", [{"role": "user", "content": "What is my dog called?"}], tools=[WEATHER], max_tokens=24)
    whole = openai_client.chat.completions.create(**kw).choices[0]
    content, calls, finishes = _collect_stream(openai_client.chat.completions.create(**kw, stream=True))
    assert finishes == [whole.finish_reason]
    if whole.message.tool_calls:
        assert [c["name"] for c in calls.values()] == [c.function.name for c in whole.message.tool_calls]
    else:
        assert content.strip() == whole.message.content and not calls


@pytest.mark.parametrize("mode", MODES)
def test_async_client_gets_the_same_call(server, openai_client, user, mode):
    kw = _kw(user, mode, tools=[WEATHER], tool_choice=NAMED)
    expected = openai_client.chat.completions.create(**kw).choices[0].message.tool_calls[0].function.arguments

    async def ask() -> str:
        async with AsyncOpenAI(base_url=server.url + "/v1", api_key=KEYS["alpha"], timeout=180, max_retries=0) as c:
            r = await c.chat.completions.create(**kw)
            return r.choices[0].message.tool_calls[0].function.arguments

    assert asyncio.run(ask()) == expected


# -- a round trip ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_a_tool_result_round_trip_ends_in_a_text_answer(openai_client, user, mode):
    first = openai_client.chat.completions.create(**_kw(user, mode, tools=[WEATHER], tool_choice=NAMED))
    call = first.choices[0].message.tool_calls[0]
    messages = [{"role": "user", "content": QUESTION},
                {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 14, "sky": "rain"}'}]
    r = openai_client.chat.completions.create(**_kw(user, mode, messages, tools=[WEATHER], tool_choice="none",
                                                    max_tokens=24))
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length") and not choice.message.tool_calls
    assert isinstance(choice.message.content, str) and choice.message.content.strip()
    # The tool turns are in the prompt: the same chat without them reads fewer tokens.
    bare = openai_client.chat.completions.create(**_kw(user, mode, messages[:1], tools=[WEATHER], tool_choice="none",
                                                       max_tokens=1))
    assert r.usage.prompt_tokens > bare.usage.prompt_tokens


# -- what is refused ------------------------------------------------------------------------------

_CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}


@pytest.mark.parametrize("fields,param", [
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "tool", "tool_call_id": "x", "content": "1"}]},
     "messages"),
    ({"messages": [{"role": "user", "content": "Hi"},
                   {"role": "assistant", "tool_calls": [{**_CALL, "function": {"name": "f", "arguments": "{"}}]}]},
     "messages"),
    ({"tools": [{"type": "function", "function": {"name": "bad", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "$defs": []}}}],
      "tool_choice": "required"}, "tools"),
], ids=["type-retrieval", "no-name", "duplicate", "named-unknown", "choice-word", "choice-without-tools",
        "tool-without-call", "arguments-not-json", "schema-uncompilable", "defs-not-an-object"])
def test_400_names_the_field(alpha, fields, param):
    assert_error(alpha.post("/v1/chat/completions", json={**CHAT, **fields}), 400, param)


def test_a_tool_message_answering_a_call_is_accepted(alpha):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None, "tool_calls": [_CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = alpha.post("/v1/chat/completions", json={**CHAT, "messages": messages})
    assert r.status_code == 200, r.text
