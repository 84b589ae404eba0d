"""Server-sent events for `stream: true`: a role chunk, text deltas, a final chunk, usage, [DONE].

Uses `KVMem.chat_stream` (text deltas, then the ChatResult) when the KVMem has it, else one
delta with the whole answer. The first item is awaited before the response starts, so a bad
request still gets its proper status; an error after that is sent as an SSE `error` event.
The chat slot taken from the gate is released when the response ends, however it ends.
Until the response starts, the server watches for the client going away itself (a forced tool
call sends nothing before its whole reply); after that, the response's own listener does.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterator

from starlette.responses import Response, StreamingResponse

from kvmem.errors import InvalidInputError, RequestCancelled
from kvmem.engine.protocol import ChoiceDelta
from kvmem.results import ToolCallDelta
from kvmem.server.chat_format import chunk, choices_of, logprobs_content, memory_info, sse, tool_call, usage
from kvmem.server.errors import ApiError, from_invalid_input

log = logging.getLogger("kvmem.server")
_END = object()


def _whole(mem, messages: list[dict], kwargs: dict) -> Iterator:
    result = mem.chat(messages, **kwargs)
    yield result.answer
    yield result


def _items(mem, messages: list[dict], kwargs: dict) -> Iterator:
    if hasattr(mem, "chat_stream"):
        return iter(mem.chat_stream(messages, **kwargs))
    return _whole(mem, messages, kwargs)


class _SlotStream(StreamingResponse):
    def __init__(self, content, release: Callable) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._release = release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._release()


async def cancel_on_disconnect(receive, cancel: threading.Event) -> None:
    """Sets `cancel` when the client goes away, so the engine aborts the generation and frees
    the chat's slot and KV blocks (the body is already read: the next message is the disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    cancel.set()


async def open_stream(rt, mem, messages, kwargs, *, meta, include_usage, on_result, request_id, release, receive):
    """The StreamingResponse (499 when the client left before it could start); `release` (async)
    runs exactly once, when it is over (or failed to start)."""
    items = None
    cancel = threading.Event()
    kwargs = {**kwargs, "cancel": cancel}
    # Stopped before the response starts: two readers of `receive` would steal each other's messages.
    watcher = asyncio.create_task(cancel_on_disconnect(receive, cancel))
    try:
        items = await rt.call(_items, mem, messages, kwargs)
        first = await rt.call(next, items, _END)
    except BaseException as e:
        await _close(rt, items)
        await release()
        if isinstance(e, RequestCancelled):
            return Response(status_code=499)  # the client left before the response started
        raise
    finally:
        watcher.cancel()

    async def done() -> None:
        cancel.set()  # a client gone mid-stream: the engine aborts (after the end: nothing to abort)
        await _close(rt, items)
        await release()

    events = _events(rt, items, first, meta, include_usage, on_result, request_id, kwargs["max_tokens"],
                     getattr(mem, "token_texts", None), kwargs["sampling"].n)
    return _SlotStream(events, done)


async def _events(rt, items, item, meta, include_usage, on_result, request_id, max_tokens, decode, n):
    for index in range(n):
        yield sse(chunk(meta, {"role": "assistant", "content": ""}, index=index))
    try:
        while isinstance(item, (str, ChoiceDelta, ToolCallDelta)):
            if isinstance(item, ToolCallDelta):
                yield sse(chunk(meta, {"tool_calls": [tool_call(item.call, item.position)]}, index=item.index))
            else:
                index, text = (0, item) if isinstance(item, str) else (item.index, item.text)
                if text:
                    yield sse(chunk(meta, {"content": text}, index=index))
            item = await rt.call(next, items, _END)
        if item is _END:
            raise RuntimeError("the chat stream ended without its result")
    except InvalidInputError as e:
        yield sse(from_invalid_input(e).body())
        return
    except RequestCancelled:
        return  # the client went away
    except Exception:  # noqa: BLE001 - the status is sent; report in-band, with the request id
        log.exception("request %s failed while streaming", request_id)
        yield sse(ApiError(500, f"internal error; request id {request_id} (it is in the server log)",
                           type="server_error", code="internal_error", extra={"request_id": request_id}).body())
        return
    on_result(item)
    for c in choices_of(item, max_tokens):  # each choice's end, with its logprobs (sent whole, at the end)
        content = logprobs_content(c, decode) if decode is not None else None
        yield sse(chunk(meta, {}, c.finish_reason, index=c.index, logprobs=None if content is None else {"content": content},
                        memory=memory_info(item)))
    if include_usage:
        yield sse(chunk(meta, None, usage=usage(item)))
    yield sse("[DONE]")


async def _close(rt, items) -> None:
    close = getattr(items, "close", None)
    if close is not None:
        try:
            await rt.call(close)
        except Exception:  # noqa: BLE001 - e.g. "generator already executing": nothing left to stop
            log.debug("closing a chat stream failed", exc_info=True)
