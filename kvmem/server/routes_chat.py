"""POST /v1/chat/completions (OpenAI's schema, streaming or not, with memory) and GET /v1/models."""

from __future__ import annotations

import asyncio
import threading
import time
from functools import partial

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kvmem.errors import RequestCancelled

from kvmem.server.chat_format import chat_kwargs, completion, kvmem_messages, new_meta
from kvmem.server.errors import ApiError
from kvmem.server.schemas import ChatRequest
from kvmem.server.streaming import cancel_on_disconnect, open_stream
from kvmem.server.tenants import CurrentTenant

router = APIRouter()
_STARTED = int(time.time())


@router.get("/v1/models")
async def list_models(request: Request, tenant: CurrentTenant) -> dict:
    names = request.app.state.model_names
    return {"object": "list",
            "data": [{"id": n, "object": "model", "created": _STARTED, "owned_by": "kvmem"} for n in names]}


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatRequest, request: Request, tenant: CurrentTenant):
    state = request.app.state
    rt = state.runtime
    mem = rt.require()
    if body.model not in state.model_names:
        raise ApiError(404, f"the model {body.model!r} does not exist; see GET /v1/models", param="model",
                       code="model_not_found")
    kwargs = chat_kwargs(body, tenant, state.settings.default_max_tokens, state.settings.max_n,
                         _tool_parser(mem))
    messages = kvmem_messages(body.messages)
    _enter(rt, state.metrics)
    meta = new_meta(body.model)
    if hasattr(mem, "trace"):  # the x-ray is kept under the completion's id
        kwargs["chat_id"] = meta["id"]
    scope = "run" if kwargs.get("run_id") else "agent" if kwargs.get("agent_id") else "user"

    def observe(result, stream: bool) -> None:
        trace = mem.trace(result.trace_id) if getattr(result, "trace_id", "") else None
        state.metrics.observe_chat(result, stream, scope, trace)
    if body.stream:
        async def release() -> None:
            rt.gate.leave()

        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await open_stream(rt, mem, messages, kwargs, meta=meta, include_usage=include_usage,
                                 on_result=lambda r: observe(r, True), request_id=request.state.request_id,
                                 release=release, receive=request.receive)
    cancel = threading.Event()
    watcher = asyncio.create_task(cancel_on_disconnect(request.receive, cancel))
    try:
        result = await rt.call(partial(mem.chat, messages, cancel=cancel, **kwargs))
    except RequestCancelled:
        return Response(status_code=499)  # nobody is left to read it
    finally:
        watcher.cancel()
        rt.gate.leave()
    observe(result, False)
    return completion(meta, result, kwargs["max_tokens"], mem.token_texts)


@router.get("/v1/chats/{chat_id}/trace")
async def chat_trace(chat_id: str, request: Request, tenant: CurrentTenant) -> dict:
    """A recent chat's x-ray: its facts with scores, which went in as KV and which as text and why,
    injected tokens, TTFT. Only the tenant that asked can read it; an old chat's is gone (404)."""
    mem = request.app.state.runtime.require()
    trace = mem.trace(chat_id)
    if trace is None or not tenant.owns(trace.user_id):
        raise ApiError(404, f"no trace of chat {chat_id!r}: unknown, another tenant's, or older than the "
                       "scope's ring of memory.trace_chats", param="chat_id", code="not_found")
    return {**trace.to_dict(), "user_id": tenant.local(trace.user_id)}


def _tool_parser(mem) -> str:
    config = getattr(mem, "config", None)  # a KVMem stand-in in tests may have none
    return config.prompt.tool_call_parser if config is not None else "hermes"


def _enter(rt, metrics) -> None:
    if not rt.gate.enter():
        metrics.rejected.labels("queue_full").inc()
        raise ApiError(429, f"too many chat requests in flight (limit {rt.gate.limit}); retry shortly",
                       type="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": "1"})
