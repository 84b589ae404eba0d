"""LangChain's ChatOpenAI (langchain-openai) pointed at `kvmem serve`, as an agent would use it:
invoke, stream and structured output, with memory in KV and text mode."""

from __future__ import annotations

import uuid

import pytest
from pydantic import BaseModel

from tests.server.serverproc import KEYS

FACTS = ["My dog is called Biscuit and loves carrots.", "I live in Porto near the river."]


class Pet(BaseModel):
    name: str
    animal: str


@pytest.fixture(scope="module")
def user(servers) -> str:
    user = f"langchain-{uuid.uuid4().hex[:8]}"
    with servers.get().client("alpha") as c:
        r = c.post("/v1/memories", json={"user_id": user, "facts": FACTS, "encode": "sync"})
    assert r.status_code == 200, r.text
    return user


def chat_model(server, user: str, mode: str, **kw):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=server.url + "/v1", api_key=KEYS["alpha"], model="kvmem", temperature=0,
                      max_retries=0, timeout=180, extra_body={"memory": {"user_id": user, "k": 2, "mode": mode}}, **kw)


@pytest.mark.parametrize("mode", ["kv", "text"])
def test_invoke_and_stream_give_the_greedy_answer(server, openai_client, user, mode):
    question = "What is my dog called?"
    llm = chat_model(server, user, mode, max_tokens=16)
    answer = llm.invoke(question)
    direct = openai_client.chat.completions.create(
        model="kvmem", messages=[{"role": "user", "content": question}], max_tokens=16, temperature=0,
        extra_body={"memory": {"user_id": user, "k": 2, "mode": mode}})
    assert answer.content == direct.choices[0].message.content and answer.content.strip()
    assert answer.response_metadata["finish_reason"] in ("stop", "length")
    streamed = "".join(chunk.content for chunk in llm.stream(question))
    assert streamed == answer.content


@pytest.mark.parametrize("mode", ["kv", "text"])
def test_with_structured_output_returns_the_model(server, user, mode):
    llm = chat_model(server, user, mode, max_tokens=64).with_structured_output(Pet, method="json_schema")
    pet = llm.invoke("Give my dog's name and what animal it is, as JSON.")
    assert isinstance(pet, Pet) and pet.name and pet.animal


class GetWeather(BaseModel):
    """Current weather in a city."""

    city: str


@pytest.mark.parametrize("mode", ["kv", "text"])
def test_bind_tools_with_a_forced_tool(server, user, mode):
    llm = chat_model(server, user, mode, max_tokens=48).bind_tools([GetWeather], tool_choice="GetWeather")
    reply = llm.invoke("What is the weather where I live?")
    (call,) = reply.tool_calls
    assert call["name"] == "GetWeather" and GetWeather.model_validate(call["args"]), reply
    assert reply.response_metadata["finish_reason"] == "tool_calls"
    chunks = list(llm.stream("What is the weather where I live?"))
    streamed = chunks[0]
    for c in chunks[1:]:
        streamed += c
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [(call["name"], call["args"])]


def test_a_tool_result_goes_back_through_langchain(server, user):
    from langchain_core.messages import HumanMessage, ToolMessage

    llm = chat_model(server, user, "kv", max_tokens=24).bind_tools([GetWeather], tool_choice="GetWeather")
    question = HumanMessage("What is the weather where I live?")
    first = llm.invoke([question])
    answer = chat_model(server, user, "kv", max_tokens=24).bind_tools([GetWeather]).invoke(
        [question, first, ToolMessage('{"sky": "rain", "celsius": 12}', tool_call_id=first.tool_calls[0]["id"])])
    assert isinstance(answer.content, str)
    assert answer.content.strip() or answer.tool_calls  # "auto": text, or another call
