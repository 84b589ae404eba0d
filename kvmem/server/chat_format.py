"""OpenAI chat shapes: request -> kvmem arguments, ChatResult -> completion, chunk and usage dicts."""

from __future__ import annotations

import json
import time
import uuid

from kvmem.server.errors import ApiError
from kvmem.server.schemas import ChatMessage, ChatRequest, MemoryOptions
from kvmem.server.tenants import Tenant


def new_meta(model: str) -> dict:
    return {"id": "chatcmpl-" + uuid.uuid4().hex, "created": int(time.time()), "model": model}


def chat_kwargs(body: ChatRequest, tenant: Tenant, default_max_tokens: int) -> dict:
    """KVMem.chat's keyword arguments for an OpenAI request (400 for what the server cannot honour)."""
    if body.stop:
        raise ApiError(400, "stop sequences are not supported", param="stop", code="unsupported_parameter")
    if body.tools:
        raise ApiError(400, "tools are not supported", param="tools", code="unsupported_parameter")
    max_tokens = body.max_completion_tokens or body.max_tokens or default_max_tokens
    return {**_scope(body, tenant), "max_tokens": max_tokens, "logprobs": None}


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
            "k": opts.k, "mode": opts.mode, "filters": opts.filters, "text_facts": opts.text_facts}


def kvmem_messages(messages: list[ChatMessage]) -> list[dict]:
    """OpenAI messages -> kvmem's user/assistant turns.

    kvmem's system message is its own (it holds the facts), so system/developer messages are
    put at the start of the first user turn.
    """
    system, turns = [], []
    for i, m in enumerate(messages):
        text = _text(m, i)
        if m.role in ("system", "developer"):
            system.append(text)
        else:
            turns.append({"role": m.role, "content": text})
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


def finish_reason(result, max_tokens: int) -> str:
    return "length" if len(result.token_ids) >= max_tokens else "stop"


def usage(result) -> dict:
    completion = len(result.token_ids)
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": completion,
            "total_tokens": result.prompt_tokens + completion, "injected_tokens": result.injected_tokens,
            "prompt_tokens_details": {"cached_tokens": result.cached_tokens}}


def memory_info(result) -> dict:
    return {"mode": result.mode, "fact_ids": list(result.fact_ids), "injected_tokens": result.injected_tokens,
            "fallbacks": result.fallbacks, "ttft_ms": round(result.ttft_s * 1000, 3)}


def completion(meta: dict, result, max_tokens: int) -> dict:
    choice = {"index": 0, "message": {"role": "assistant", "content": result.answer}, "logprobs": None,
              "finish_reason": finish_reason(result, max_tokens)}
    return {**meta, "object": "chat.completion", "choices": [choice], "usage": usage(result),
            "memory": memory_info(result)}


def chunk(meta: dict, delta: dict | None = None, finish: str | None = None, **extra) -> dict:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
    return {**meta, "object": "chat.completion.chunk", "choices": choices, **extra}


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"
