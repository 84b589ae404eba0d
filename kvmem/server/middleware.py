"""ASGI middleware: a request id on every response and log line of a failure, and a body size limit.

Both are plain ASGI (not BaseHTTPMiddleware), so streaming responses pass through untouched.
"""

from __future__ import annotations

import logging
import uuid

from kvmem.server.errors import ApiError

log = logging.getLogger("kvmem.server")


def new_request_id() -> str:
    return "req-" + uuid.uuid4().hex[:20]


class RequestContext:
    """Tags the request with an id (header x-request-id); turns an unexpected exception into a 500 with it."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = new_request_id()
        scope.setdefault("state", {})["request_id"] = rid
        started = False

        async def tagged(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid.encode())]
            await send(message)

        try:
            await self.app(scope, receive, tagged)
        except Exception:  # noqa: BLE001 - the one place unexpected errors end up
            log.exception("request %s failed: %s %s", rid, scope.get("method"), scope.get("path"))
            if started:
                raise  # the status is already sent; let the server drop the connection
            error = ApiError(500, f"internal error; request id {rid} (it is in the server log)",
                             type="server_error", code="internal_error", extra={"request_id": rid})
            await error.response()(scope, receive, tagged)


class BodyLimit:
    """Refuses a request body over `limit` bytes with 413, by Content-Length or by counting."""

    def __init__(self, app, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers", [])).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await self._refuse(scope, receive, send)
        chunks, size = [], 0
        while True:  # buffered: every route reads the whole (JSON) body anyway
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await self._refuse(scope, receive, send)
            if not message.get("more_body"):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _refuse(self, scope, receive, send) -> None:
        error = ApiError(413, f"request body is larger than the limit of {self.limit} bytes",
                         code="request_too_large", headers={"connection": "close"})
        await error.response()(scope, receive, send)


def _replay(body: bytes, receive):
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # then the server's own messages (disconnect)

    return replay
