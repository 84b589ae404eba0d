"""The ASGI app: routes, error handlers, middleware, and the engine's lifecycle (lifespan)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import asynccontextmanager
from functools import partial

import anyio.to_thread
from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from kvmem.config import Config
from kvmem.mcp.server import HttpDoor
from kvmem.server import errors, routes_chat, routes_mem0, routes_memory, routes_ops, ui
from kvmem.server.metrics import Metrics
from kvmem.server.middleware import BodyLimit, RequestContext
from kvmem.server.ratelimit import RateLimiter, enforce
from kvmem.server.runtime import Runtime
from kvmem.server.settings import ServerSettings
from kvmem.server.tenants import KeyRing

log = logging.getLogger("kvmem.server")
ALIAS = "kvmem"  # always names the served model, whatever it is


def served_names(settings: ServerSettings, config: Config) -> list[str]:
    from kvmem.model.bundled import DEFAULT

    name = settings.served_model_name or config.engine.model or DEFAULT.folder
    return [name] if name == ALIAS else [name, ALIAS]


def engine_dead(mem) -> bool:
    """The in-process engine died for good (vLLM's engine process exited): the runtime rebuilds
    it. A gateway's replicas come and go by themselves and are never rebuilt from here."""
    return bool(getattr(getattr(mem, "engine", None), "dead", False))


def create_app(settings: ServerSettings | None = None, config: Config | None = None,
               mem_factory: Callable[[], object] | None = None,
               on_engine_failure: Callable[[], None] | None = None) -> FastAPI:
    """mem_factory builds the KVMem (default: the real engine with its background encoder)."""
    settings = settings or ServerSettings()
    config = config or Config.from_env()
    if mem_factory is None:
        def mem_factory():
            from kvmem.service import KVMem

            return KVMem(config, background=True)

    runtime = Runtime(mem_factory, settings.max_inflight, on_engine_failure, dead=engine_dead)
    keys = KeyRing(settings.api_keys)
    metrics = Metrics(runtime)
    # Per tenant; one limit across every gateway on the same Redis (server/ratelimit.py).
    limiter = RateLimiter(settings.rate_limit_per_min, config.kv.shared_url) if settings.rate_limit_per_min else None
    # The MCP tools at /mcp (docs/agents.md), under the same per-tenant rate as the API.
    mcp = HttpDoor(runtime, keys.tenant, host=settings.host,
                   admit=partial(enforce, limiter, metrics) if limiter is not None else None)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # KVMem calls block a thread each: room for every admitted chat, and memory calls besides.
        anyio.to_thread.current_default_thread_limiter().total_tokens = settings.max_inflight + 32
        runtime.start()
        async with mcp.running():
            yield
        await run_in_threadpool(runtime.close, settings.graceful_timeout_s)

    docs = {} if settings.docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="kvmem", summary="OpenAI-compatible chat with memory; Mem0-shaped memory API",
                  lifespan=lifespan, **docs)
    app.state.settings = settings
    app.state.runtime = runtime
    app.state.keys = keys
    app.state.metrics = metrics
    app.state.rate_limiter = limiter
    app.state.model_names = served_names(settings, config)
    errors.install(app)
    for module in (routes_chat, routes_memory, routes_mem0, routes_ops):
        app.include_router(module.router)
    app.router.routes.append(mcp.route)
    if settings.ui:
        ui.install(app)
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    app.add_middleware(RequestContext)  # added last: outermost, so it also tags 413s
    return app
