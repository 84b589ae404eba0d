"""GET /health (503 until the engine is ready) and GET /metrics (Prometheus text). No key needed."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from kvmem.server.errors import ApiError
from kvmem.server.metrics import CONTENT_TYPE

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    rt = request.app.state.runtime
    if rt.mem is None:
        try:
            rt.require()  # 503 in OpenAI's error shape: loading, or why the start failed
        except ApiError as e:
            return e.response()
    return JSONResponse({"status": "ok", "inflight_chats": rt.gate.count, "max_inflight": rt.gate.limit})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    body = await run_in_threadpool(request.app.state.metrics.render)  # reads SQLite and the KV folder
    return Response(body, media_type=CONTENT_TYPE)
