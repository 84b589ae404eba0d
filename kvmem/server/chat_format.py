"""OpenAI chat shapes: request -> kvmem arguments, ChatResult -> completion, chunk and usage dicts."""

from __future__ import annotations

import json
import time
import uuid

from kvmem.engine.sampling import MAX_LOGIT_BIAS, MAX_N, MAX_TOKEN_ID, Sampling
from kvmem.engine.tools import Tools
from kvmem.results import Choice
from kvmem.server.errors import ApiError
from kvmem.server.schemas import ChatMessage, ChatRequest, MemoryOptions
from kvmem.server.tenants import Tenant


def new_meta(model: str) -> dict:
    return {"id": "chatcmpl-" + uuid.uuid4().hex, "created": int(time.time()), "model": model}


def chat_kwargs(body: ChatRequest, tenant: Tenant, default_max_tokens: int, max_n: int = MAX_N,
                tool_parser: str = "hermes") -> dict:
    """KVMem.chat's keyword arguments for an OpenAI request (400 for what the server cannot honour)."""
    if body.n > max_n:
        raise ApiError(400, f"n is at most {max_n} on this server, got {body.n}", param="n", code="invalid_value")
    max_tokens = body.max_completion_tokens or body.max_tokens or default_max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    tools = Tools.from_openai(body.tools, body.tool_choice, body.parallel_tool_calls, tool_parser)
    return {**_scope(body, tenant), "max_tokens": max_tokens, "logprobs": logprobs, "sampling": sampling(body),
            **({"tools": tools} if tools is not None else {})}


def sampling(body: ChatRequest) -> Sampling:
    """The request's sampling fields; those it leaves out keep Sampling's (greedy) defaults."""
    given = {name: getattr(body, name) for name in _SAMPLING_FIELDS if getattr(body, name) is not None}
    if body.stop is not None:
        given["stop"] = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop)
    if body.stop_token_ids:
        given["stop_token_ids"] = tuple(body.stop_token_ids)
    if body.logit_bias:
        given["logit_bias"] = _logit_bias(body.logit_bias)
    return Sampling(**given, **_response_format(body.response_format))


_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "n")


def _logit_bias(bias: dict) -> dict[int, float]:
    """OpenAI's {"token id": bias} (ids as strings, as JSON keys must be); Sampling checks the ids.

    Checked before int() and float(), which raise on what JSON can carry: a key of Unicode digits
    ("²"), one of thousands of digits, a bias past float's range (each was a 500)."""
    out = {}
    for key, value in bias.items():
        token = key.isascii() and key.isdigit() and len(key) <= len(str(MAX_TOKEN_ID))
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not (token and number and -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS):
            raise ApiError(400, f"logit_bias maps token ids (0 to {MAX_TOKEN_ID}) to numbers in "
                           f"[{-MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}]; got {key!r}: {value!r}", param="logit_bias",
                           code="invalid_value")
        out[int(key)] = float(value)
    return out


def _response_format(fmt: dict | None) -> dict:
    """OpenAI's response_format -> Sampling's structured-output fields."""
    kind = (fmt or {}).get("type", "text")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_object": True}
    schema = ((fmt or {}).get("json_schema") or {}).get("schema") if kind == "json_schema" else None
    if not isinstance(schema, dict):
        raise ApiError(400, "response_format must be {type: text}, {type: json_object} or {type: json_schema, "
                       "json_schema: {name, schema}}", param="response_format", code="invalid_value")
    return {"json_schema": schema}


def _scope(body: ChatRequest, tenant: Tenant) -> dict:
    """Whose facts: the `memory` object's user_id, else the standard `user` field; neither: no memory."""
    opts = body.memory or MemoryOptions()
    user, param = (opts.user_id, "memory.user_id") if opts.user_id is not None else (body.user, "user")
    if user is None:
        if body.memory is not None and opts.mode != "off":
            raise ApiError(400, "memory.user_id (or user) is required unless memory.mode is 'off'",
                           param="memory.user_id", code="missing_required_parameter")
        return {"user_id": tenant.anonymous, "mode": "off"}
    return {"user_id": tenant.user_id(user, param), "agent_id": opts.agent_id, "run_id": opts.run_id,
            "k": opts.k, "mode": opts.mode, "filters": opts.filters, "text_facts": opts.text_facts,
            "fidelity": opts.fidelity,
            "store": opts.store}


def kvmem_messages(messages: list[ChatMessage]) -> list[dict]:
    """OpenAI messages -> kvmem's user/assistant/tool turns (engine/tools.py checks the tool ones).

    kvmem's system message is its own (it holds the facts), so system/developer messages are
    put at the start of the first user turn.
    """
    system, turns = [], []
    for i, m in enumerate(messages):
        text = _text(m, i)
        if m.role in ("system", "developer"):
            system.append(text)
        elif m.role == "tool":
            turns.append({"role": "tool", "content": text, "tool_call_id": m.tool_call_id})
        else:
            turns.append({"role": m.role, "content": text, **({"tool_calls": m.tool_calls} if m.tool_calls else {})})
    if system:
        first = next((t for t in turns if t["role"] == "user"), None)
        if first is None:
            turns.insert(0, first := {"role": "user", "content": ""})
        first["content"] = "\n\n".join([*system, first["content"]]).strip()
    return turns


def _text(m: ChatMessage, i: int) -> str:
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    for j, part in enumerate(m.content):
        if part.type != "text" or part.text is None:
            raise ApiError(400, f"content part type {part.type!r} is not supported; only 'text'",
                           param=f"messages[{i}].content[{j}]", code="unsupported_content")
    return "\n".join(part.text for part in m.content)


def choices_of(result, max_tokens: int = 0) -> tuple:
    """Every choice of a ChatResult. One made without choices (a KVMem stand-in) has only its
    answer, finished by length when it used all of max_tokens."""
    if result.choices:
        return result.choices
    reason = "length" if max_tokens and len(result.token_ids) >= max_tokens else "stop"
    return (Choice(0, result.answer, result.token_ids, reason),)


def logprobs_content(choice, decode) -> list[dict] | None:
    """OpenAI's choice.logprobs.content: per token its text, logprob, UTF-8 bytes and top-n.
    `decode(ids) -> texts` (KVMem.token_texts)."""
    if choice.logprobs is None:
        return None
    ids = [t.token_id for t in choice.logprobs] + [i for t in choice.logprobs for i, _ in t.top]
    text = dict(zip(ids, decode(ids)))

    def entry(token_id: int, logprob: float) -> dict:
        return {"token": text[token_id], "logprob": logprob, "bytes": list(text[token_id].encode())}

    return [{**entry(t.token_id, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top]}
            for t in choice.logprobs]


def usage(result) -> dict:
    completion = sum(len(c.token_ids) for c in choices_of(result))
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": completion,
            "total_tokens": result.prompt_tokens + completion, "injected_tokens": result.injected_tokens,
            "prompt_tokens_details": {"cached_tokens": result.cached_tokens}}


def memory_info(result) -> dict:
    return {"mode": result.mode, "fact_ids": list(result.fact_ids), "injected_tokens": result.injected_tokens,
            "fallbacks": result.fallbacks, "recomputed_tokens": result.recomputed_tokens,
            "ttft_ms": round(result.ttft_s * 1000, 3),
            "stored": list(getattr(result, "stored", ()))}


def completion(meta: dict, result, max_tokens: int, decode) -> dict:
    choices = [{"index": c.index, "message": message(c), "logprobs": _logprobs(c, decode),
                "finish_reason": c.finish_reason} for c in choices_of(result, max_tokens)]
    return {**meta, "object": "chat.completion", "choices": choices, "usage": usage(result),
            "memory": memory_info(result)}


def message(choice) -> dict:
    """A choice's assistant message: its text, or its tool calls and the text beside them."""
    if not choice.tool_calls:
        return {"role": "assistant", "content": choice.answer}
    return {"role": "assistant", "content": choice.content,
            "tool_calls": [tool_call(call) for call in choice.tool_calls]}


def tool_call(call, position: int | None = None) -> dict:
    """OpenAI's tool call; with `position`, the streamed delta form (its index among the calls)."""
    out = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return out if position is None else {"index": position, **out}


def _logprobs(choice, decode) -> dict | None:
    content = logprobs_content(choice, decode)
    return None if content is None else {"content": content}


def chunk(meta: dict, delta: dict | None = None, finish: str | None = None, *, index: int = 0,
          logprobs: dict | None = None, **extra) -> dict:
    choices = [] if delta is None else [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]
    return {**meta, "object": "chat.completion.chunk", "choices": choices, **extra}


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"
