"""GET /health (503 until the engine is ready) and GET /metrics (Prometheus text). No key needed."""

from __future__ import annotations

import anyio
import anyio.to_thread
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvmem.server.errors import ApiError
from kvmem.server.metrics import CONTENT_TYPE

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    rt = request.app.state.runtime
    if rt.mem is None or rt.draining:
        try:
            rt.require()  # 503 in OpenAI's error shape: loading, or why the start failed
        except ApiError as e:
            return e.response()
    return JSONResponse({"status": "ok", "inflight_chats": rt.gate.count, "max_inflight": rt.gate.limit})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Rendered on a thread of its own, never queued behind the KVMem calls that fill the shared
    pool: a scrape must answer while the server is busiest."""
    state = request.app.state
    if getattr(state, "metrics_limiter", None) is None:
        state.metrics_limiter = anyio.CapacityLimiter(1)
    body = await anyio.to_thread.run_sync(state.metrics.render, limiter=state.metrics_limiter)
    return Response(body, media_type=CONTENT_TYPE)
