"""OpenAI sampling and structured output on `POST /v1/chat/completions`, through the official client.

What the server must honour, as vLLM honours it, in `memory.mode` "kv" and "text":
- sampling: `temperature` (0, or no sampling field at all, is greedy), `top_p`, `top_k`, `min_p`,
  `seed`, the penalties, `logit_bias`, `max_tokens` / `max_completion_tokens`, `stop` (a string or
  a list), `stop_token_ids`, `n` > 1 (up to the server's cap, 8 by default), `logprobs` with
  `top_logprobs`; streamed (one chunk stream carrying every choice's index) and not, sync and async;
- structured output: `response_format` json_object and json_schema (also through the client's
  `chat.completions.parse` with a pydantic model): the reply parses and validates;
- what is not honoured (or out of range) is a 400 in OpenAI's error shape whose `param` names the field.

One user's facts are stored once for the module (KV encoded, "encode": "sync"); max_tokens stay
small, since every request decodes on the CPU. JSON replies get more room (64 tokens): a reply cut
by max_tokens would not parse.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import jsonschema
import pytest
from openai import AsyncOpenAI
from pydantic import BaseModel

from tests.server.conftest import assert_error
from tests.server.serverproc import KEYS

MODES = ["kv", "text"]
FACTS = ["My dog is called Biscuit and loves carrots.", "I live in Galway and work as a ferry mechanic.",
         "My grandmother knits blue scarves every winter."]
QUESTION = "What is my dog called, and what does he love?"
STORY = "Tell me a long story about my dog Biscuit."
JSON_SYSTEM = 'Reply with one JSON object only, for example {"name": "Rex", "animal": "cat"}.'
JSON_QUESTION = "What is my dog's name, and what animal is it? Answer in JSON."
PET_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "animal": {"type": "string"}},
              "required": ["name", "animal"], "additionalProperties": False}
JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET_SCHEMA, "strict": True}}
CHAT = {"model": "kvmem", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


class Pet(BaseModel):
    name: str
    animal: str


# -- fixtures and helpers -------------------------------------------------------------------------


def _store(servers, facts: list[str], prefix: str) -> str:
    user = f"{prefix}-{uuid.uuid4().hex[:8]}"
    with servers.get().client("alpha") as c:
        r = c.post("/v1/memories", json={"user_id": user, "facts": facts, "encode": "sync"})
    assert r.status_code == 200, r.text
    assert all(m["kv_status"] == "encoded" for m in r.json()["results"]), r.text
    return user


@pytest.fixture(scope="module")
def user(servers) -> str:
    """A user with three facts, KV encoded, shared by the module's tests."""
    return _store(servers, FACTS, "sampling")


@pytest.fixture(scope="module")
def one_fact_user(servers) -> str:
    """A user with exactly one fact: injected alone, it sits where it was encoded."""
    return _store(servers, FACTS[:1], "sampling-one")


def _memory(user: str, mode: str, k: int = 3) -> dict:
    return {"memory": {"user_id": user, "k": k, "mode": mode}}


def _kw(user: str, mode: str = "kv", question: str = QUESTION, *, k: int = 3, system: str | None = None,
        extra: dict | None = None, **fields) -> dict:
    """`chat.completions.create` keyword arguments: the question with the user's memory, plus `fields`."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    fields.setdefault("max_tokens", 16)
    return {"model": "kvmem", "messages": messages, "extra_body": {**_memory(user, mode, k), **(extra or {})},
            **fields}


def _ask(client, user: str, mode: str = "kv", question: str = QUESTION, **kw):
    r = client.chat.completions.create(**_kw(user, mode, question, **kw))
    assert r.object == "chat.completion", r
    assert r.model_extra["memory"]["mode"] == mode, r.model_extra["memory"]
    return r


def _text(client, user: str, mode: str = "kv", question: str = QUESTION, **kw) -> str:
    r = _ask(client, user, mode, question, **kw)
    assert len(r.choices) == 1
    return r.choices[0].message.content or ""


def _async_client(server) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=server.url + "/v1", api_key=KEYS["alpha"], timeout=180, max_retries=0)


def _collect(chunks) -> tuple[dict[int, str], dict[int, list[str]], list]:
    """Streamed chunks -> text per choice index, finish reasons per index, logprob entries (all choices)."""
    texts: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    logprobs: list = []
    for chunk in chunks:
        assert chunk.object == "chat.completion.chunk"
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finishes.setdefault(choice.index, []).append(choice.finish_reason)
            if choice.logprobs is not None and choice.logprobs.content:
                logprobs.extend(choice.logprobs.content)
    return texts, finishes, logprobs


def _check_logprob_entry(entry, top: int) -> None:
    assert isinstance(entry.token, str)
    assert isinstance(entry.logprob, float) and entry.logprob <= 0.0, entry
    assert entry.bytes is None or all(isinstance(b, int) and 0 <= b <= 255 for b in entry.bytes), entry
    if entry.bytes is not None and "\ufffd" not in entry.token:
        assert bytes(entry.bytes) == entry.token.encode("utf-8"), entry
    assert len(entry.top_logprobs) == top, entry
    values = [t.logprob for t in entry.top_logprobs]
    assert values == sorted(values, reverse=True), entry
    assert all(v <= 0.0 for v in values), entry
    for alt in entry.top_logprobs:
        if alt.token == entry.token:
            assert alt.logprob == pytest.approx(entry.logprob, abs=1e-4), entry


def _stop_word(answer: str) -> str:
    """A word of `answer` whose first occurrence comes after some visible text."""
    for word in answer.split()[1:]:
        word = word.strip(".,!?;:\"'()")
        if word and answer[:answer.find(word)].strip():
            return word
    raise AssertionError(f"no word to stop at in the greedy answer {answer!r}")


# -- greedy default, seeds, n ---------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_temperature_zero_is_the_greedy_default(openai_client, user, mode):
    default = _text(openai_client, user, mode)
    assert default.strip()
    assert _text(openai_client, user, mode, temperature=0) == default


def test_a_seed_reproduces_a_sampled_answer(openai_client, user):
    first = _text(openai_client, user, temperature=1.0, seed=1234)
    assert first == _text(openai_client, user, temperature=1.0, seed=1234)


def test_different_seeds_give_different_answers(openai_client, user):
    answers = {_text(openai_client, user, temperature=1.5, top_p=1.0, seed=seed, max_tokens=16)
               for seed in (1, 2, 3, 4)}
    assert len(answers) >= 2, answers


def test_every_sampling_field_is_accepted_and_seeded(openai_client, user):
    kw = dict(temperature=0.8, top_p=0.9, seed=77, presence_penalty=0.5, frequency_penalty=0.5, max_tokens=12,
              extra={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.2, "stop_token_ids": []})
    first = _text(openai_client, user, **kw)
    assert first.strip()
    assert _text(openai_client, user, **kw) == first


@pytest.mark.parametrize("mode", MODES)
def test_n_choices_each_counted_in_usage(openai_client, user, mode):
    r = _ask(openai_client, user, mode, n=3, temperature=1.0, seed=42, max_tokens=12, logprobs=True)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for c in r.choices:
        assert c.message.role == "assistant" and c.message.content is not None
        assert c.finish_reason in ("stop", "length")
        if c.finish_reason == "length":
            assert len(c.logprobs.content) == 12
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)  # all choices count
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    memory = r.model_extra["memory"]
    assert len(memory["fact_ids"]) == 3
    if mode == "kv":  # every choice reads the injected facts (or the KV-mode blocks an earlier ask cached)
        assert memory["injected_tokens"] + r.usage.prompt_tokens_details.cached_tokens > 0
    else:
        assert memory["injected_tokens"] == 0


def test_n_up_to_the_cap_of_eight(openai_client):
    r = openai_client.chat.completions.create(model="kvmem", messages=[{"role": "user", "content": "Hi"}],
                                              n=8, temperature=1.0, seed=3, max_tokens=2)
    assert [c.index for c in r.choices] == list(range(8))


# -- stopping -------------------------------------------------------------------------------------


def test_stop_strings_end_the_answer_before_them(openai_client, user):
    greedy = _text(openai_client, user, question=STORY, max_tokens=24)
    word = _stop_word(greedy)
    expected = greedy[:greedy.find(word)].strip()
    for stop in ([word], word):  # a list, and a lone string
        r = _ask(openai_client, user, question=STORY, max_tokens=24, stop=stop)
        assert (r.choices[0].message.content or "").strip() == expected, (stop, greedy)
        assert r.choices[0].finish_reason == "stop"


def test_max_tokens_ends_with_length(openai_client, user):
    for field in ("max_tokens", "max_completion_tokens"):
        r = openai_client.chat.completions.create(
            model="kvmem", messages=[{"role": "user", "content": STORY}], extra_body=_memory(user, "kv"), **{field: 3})
        assert r.choices[0].finish_reason == "length", field
        assert r.usage.completion_tokens == 3, field


def test_logit_bias_and_stop_token_ids(openai_client, user, tokenizer):
    ids = tokenizer.encode(" the", add_special_tokens=False)
    assert len(ids) == 1
    bias = {str(ids[0]): 100}
    forced = _ask(openai_client, user, max_tokens=4, logit_bias=bias)
    assert forced.choices[0].message.content.strip() == tokenizer.decode(ids * 4).strip()
    stopped = _ask(openai_client, user, max_tokens=4, logit_bias=bias, extra={"stop_token_ids": ids})
    assert (stopped.choices[0].message.content or "") == ""  # the stop token itself is not in the text
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens == 1


# -- logprobs -------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_logprobs_with_top_logprobs(openai_client, user, mode):
    r = _ask(openai_client, user, mode, max_tokens=12, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert isinstance(content, list) and len(content) == r.usage.completion_tokens
    for entry in content:
        _check_logprob_entry(entry, 3)
        assert entry.token == entry.top_logprobs[0].token  # greedy: the sampled token is the most likely
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-4)
    plain = _ask(openai_client, user, mode, max_tokens=4)
    assert plain.choices[0].logprobs is None


# -- streaming and async --------------------------------------------------------------------------


def test_streamed_n_choices_match_the_unstreamed_ones(openai_client, user):
    kw = _kw(user, n=2, temperature=1.0, seed=5, max_tokens=12)
    whole = openai_client.chat.completions.create(**kw)
    chunks = list(openai_client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    texts, finishes, _ = _collect(chunks)
    assert sorted(texts) == [0, 1]
    assert {i: len(f) for i, f in finishes.items()} == {0: 1, 1: 1}
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert {i: f[0] for i, f in finishes.items()} == {c.index: c.finish_reason for c in whole.choices}
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_streamed_logprobs(openai_client, user):
    kw = _kw(user, max_tokens=10, logprobs=True)
    whole = openai_client.chat.completions.create(**kw)
    texts, _, entries = _collect(openai_client.chat.completions.create(**kw, stream=True))
    assert texts[0] == whole.choices[0].message.content
    assert entries, "no logprobs in the streamed chunks"
    assert [e.token for e in entries] == [e.token for e in whole.choices[0].logprobs.content]
    for streamed, unstreamed in zip(entries, whole.choices[0].logprobs.content):
        assert streamed.logprob == pytest.approx(unstreamed.logprob, abs=1e-3)


def test_async_client_matches_the_sync_one(server, openai_client, user):
    kw = _kw(user, temperature=1.0, seed=99, max_tokens=12)
    sync = openai_client.chat.completions.create(**kw).choices[0].message.content

    async def ask() -> tuple[str, str]:
        async with _async_client(server) as client:
            whole = await client.chat.completions.create(**kw)
            stream = await client.chat.completions.create(**kw, stream=True)
            streamed = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            return whole.choices[0].message.content, streamed

    whole, streamed = asyncio.run(ask())
    assert whole == sync and streamed == sync


# -- structured output ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_json_object(openai_client, user, mode):
    r = _ask(openai_client, user, mode, JSON_QUESTION, system=JSON_SYSTEM, max_tokens=64,
             response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.parametrize("mode", MODES)
def test_json_schema(openai_client, user, mode):
    r = _ask(openai_client, user, mode, JSON_QUESTION, system=JSON_SYSTEM, max_tokens=64,
             response_format=JSON_SCHEMA_FORMAT)
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    jsonschema.validate(json.loads(r.choices[0].message.content), PET_SCHEMA)
    Pet.model_validate_json(r.choices[0].message.content)


@pytest.mark.parametrize("mode", MODES)
def test_parse_with_a_pydantic_model(openai_client, user, mode):
    r = openai_client.chat.completions.parse(**_kw(user, mode, JSON_QUESTION, system=JSON_SYSTEM, max_tokens=64),
                                             response_format=Pet)
    assert isinstance(r.choices[0].message.parsed, Pet), r.choices[0].message.content
    assert r.model_extra["memory"]["mode"] == mode


def test_kv_reply_equals_text_reply_for_one_fact(openai_client, one_fact_user):
    kw = dict(k=1, system=JSON_SYSTEM, temperature=0, max_tokens=48, response_format=JSON_SCHEMA_FORMAT)
    kv = _ask(openai_client, one_fact_user, "kv", JSON_QUESTION, **kw)
    text = _ask(openai_client, one_fact_user, "text", JSON_QUESTION, **kw)
    assert kv.model_extra["memory"]["injected_tokens"] > 0
    assert text.model_extra["memory"]["injected_tokens"] == 0
    assert kv.model_extra["memory"]["fact_ids"] == text.model_extra["memory"]["fact_ids"]
    assert kv.choices[0].message.content == text.choices[0].message.content
    jsonschema.validate(json.loads(kv.choices[0].message.content), PET_SCHEMA)


# -- what is refused ------------------------------------------------------------------------------

@pytest.mark.parametrize("fields,param", [
    ({"n": 1000}, "n"),
    ({"n": 9}, "n"),  # the default cap is 8
    ({"n": 0}, "n"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logit_bias": {"100": 101}}, "logit_bias"),
    ({"logit_bias": {"100": -101}}, "logit_bias"),
    ({"logit_bias": {"not-a-token": 5}}, "logit_bias"),
    ({"logit_bias": {str(10**7): 5}}, "logit_bias"),  # beyond the vocabulary
    ({"temperature": -1}, "temperature"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "nonsense"}}}},
     "response_format"),
], ids=["n-1000", "n-9", "n-0", "top_logprobs-21", "bias-101", "bias--101", "bias-key-word", "bias-key-oov",
        "temperature--1", "schema-invalid"])
def test_400_names_the_field(alpha, fields, param):
    assert_error(alpha.post("/v1/chat/completions", json={**CHAT, **fields}), 400, param)


def test_response_format_text_is_accepted(alpha):
    r = alpha.post("/v1/chat/completions", json={**CHAT, "response_format": {"type": "text"}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] is not None


def test_memory_store_writes_the_turn_and_reply_back_for_the_next_chat(openai_client, alpha):
    """memory.store "both": the user turn and the reply become facts of the scope, listed in the
    response, searchable at once, encoded in the background, then injected into the next chat."""
    user = f"store-{uuid.uuid4().hex[:8]}"
    turn = "My neighbour's parrot is called Captain Flint."
    r = openai_client.chat.completions.create(
        model="kvmem", messages=[{"role": "user", "content": turn}], max_tokens=8,
        extra_body={"memory": {"user_id": user, "store": "both"}})
    stored = r.model_extra["memory"]["stored"]
    assert len(stored) == 2  # the user turn and the reply
    texts = {alpha.get(f"/v1/memories/{i}").json()["memory"] for i in stored}
    assert f"user: {turn}" in texts and any(t.startswith("assistant: ") for t in texts)
    hits = alpha.post("/v1/memories/search", json={"user_id": user, "query": "parrot name"}).json()["results"]
    assert stored[0] in [h["id"] for h in hits]
    deadline = time.monotonic() + 120
    while alpha.get(f"/v1/memories/{stored[0]}").json()["kv_status"] != "encoded":
        assert time.monotonic() < deadline, "the stored turn was never encoded"
        time.sleep(0.5)
    nxt = openai_client.chat.completions.create(
        model="kvmem", messages=[{"role": "user", "content": "What is the parrot called?"}], max_tokens=4,
        extra_body={"memory": {"user_id": user, "k": 2}})
    memory = nxt.model_extra["memory"]
    assert stored[0] in memory["fact_ids"] and memory["injected_tokens"] > 0 and memory["stored"] == []
