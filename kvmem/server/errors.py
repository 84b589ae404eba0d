"""Errors in OpenAI's shape, {"error": {"message", "type", "param", "code"}}, with the right status.

Bad input is never a 500: pydantic's validation errors and kvmem's InvalidInputError become
400/413/422, unknown (or another tenant's) ids 404. A facts database that cannot be reached or
is full (StoreUnavailableError) is a 503 `store_unavailable` with Retry-After, the engine's
failures a 503 `engine_unavailable`. Anything unexpected becomes a 500 that carries the request
id, which is also in the log (see middleware.py).
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvmem.config import ConfigError
from kvmem.errors import EngineError, InvalidInputError, StoreUnavailableError, UnknownFactError

INVALID = "invalid_request_error"


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, type: str = INVALID, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None, extra: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}
        self.extra = extra or {}

    def body(self) -> dict:
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return {"error": {**error, **self.extra}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def not_found(what: str, param: str | None = None) -> ApiError:
    return ApiError(404, f"{what} not found", param=param, code="not_found")


_STATUS = {  # InvalidInputError.code -> HTTP status; the code doubles as OpenAI's `code` field
    InvalidInputError.INVALID_VALUE: 400,
    InvalidInputError.FACT_TOO_LARGE: 413,
    InvalidInputError.CONTEXT_LENGTH_EXCEEDED: 422,
}


def from_invalid_input(e: InvalidInputError, param: str | None = None) -> ApiError:
    """kvmem's InvalidInputError as the response its code stands for.

    Status and param come from the fields set where it was raised, never from the message:
    messages are for people and get reworded. A `param` given here (the caller knows the
    request field better than the library did) wins over the error's own."""
    return ApiError(_STATUS[e.code], str(e), param=param or e.param, code=e.code)


_UNION_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def validation_param(loc: tuple) -> str | None:
    """('body', 'messages', 0, 'role') -> 'messages[0].role'; pydantic's union member tags
    ('messages', 'str') and ('messages', 'list[MemoryMessage]') name no field and are dropped."""
    out = ""
    for part in loc[1:] if loc and loc[0] in ("body", "query", "path", "header") else loc:
        if isinstance(part, str) and (part in _UNION_TAGS or "[" in part):
            continue
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None


async def _on_api_error(request: Request, exc: ApiError) -> JSONResponse:
    return exc.response()


async def _on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
    # The deepest error: a value matching no member of a union (content: str | list of parts) has
    # one error per member, and the one inside a part names the field at fault, not the union.
    first = max(exc.errors(), key=lambda e: len(validation_param(tuple(e.get("loc", ()))) or ""),
                default={"loc": (), "msg": "invalid request"})
    param = validation_param(tuple(first.get("loc", ())))
    message = f"{param}: {first['msg']}" if param else str(first["msg"])
    return ApiError(400, message, param=param, code="invalid_value").response()


async def _on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return ApiError(exc.status_code, str(exc.detail), code=kind, headers=getattr(exc, "headers", None)).response()


async def _on_unknown_fact(request: Request, exc: UnknownFactError) -> JSONResponse:
    return not_found("memory").response()  # the id is not echoed: it may be another tenant's


async def _on_invalid(request: Request, exc: InvalidInputError) -> JSONResponse:
    return from_invalid_input(exc).response()


ENGINE_RETRY_AFTER_S = 5  # an engine or replica that failed a request: a failover or a rebuild takes seconds


async def _on_engine(request: Request, exc: EngineError) -> JSONResponse:
    return ApiError(503, f"the engine is unavailable: {exc}", type="server_error", code="engine_unavailable",
                    headers={"Retry-After": str(ENGINE_RETRY_AFTER_S)}).response()


async def _on_store(request: Request, exc: StoreUnavailableError) -> JSONResponse:
    """Retrying is safe: a write was rolled back whole, or committed before the database went
    away (an add retried then finds its fact again: de-duplication)."""
    return ApiError(503, f"the facts database is unavailable: {exc}", type="server_error", code=exc.code,
                    headers={"Retry-After": str(exc.RETRY_AFTER_S)}).response()


async def _on_config(request: Request, exc: ConfigError) -> JSONResponse:
    """A setting found wrong only when a request needed it (e.g. prompt.tool_call_parser): the
    server's fault, said plainly rather than as an anonymous internal error."""
    return ApiError(500, f"server configuration: {exc}", type="server_error", code="server_misconfigured").response()


def install(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation)
    app.add_exception_handler(StarletteHTTPException, _on_http)
    app.add_exception_handler(UnknownFactError, _on_unknown_fact)
    app.add_exception_handler(InvalidInputError, _on_invalid)
    app.add_exception_handler(EngineError, _on_engine)
    app.add_exception_handler(StoreUnavailableError, _on_store)
    app.add_exception_handler(ConfigError, _on_config)
