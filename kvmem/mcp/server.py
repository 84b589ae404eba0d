"""The MCP server: kvmem's memory tools on the `mcp` SDK's MCPServer, over stdio or streamable HTTP.

Two ways in, one set of tools (tools.py):
- `http_door(...)`: the streamable-HTTP endpoint `kvmem serve` and `kvmem gateway` mount at /mcp,
  on the server's own KVMem (its Runtime) and its API keys. Stateless and JSON-answered: each
  POST stands alone, so nothing is held open across the server's graceful shutdown.
- `run_stdio(...)`: `kvmem mcp`, one process per agent, on a KVMem opened over a data folder.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

import anyio.to_thread
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.streamable_http_manager import StreamableHTTPASGIApp
from mcp_types import ToolAnnotations
from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse
from starlette.routing import Route

from kvmem.mcp.caller import Caller, TenantOf, from_headers
from kvmem.mcp.tools import Backend, MemoryTools

INSTRUCTIONS = """Long-term memory of the user you are working for, kept by kvmem. Memories you store \
here are also injected into the chat model's context (as KV) when it answers this user. Search \
before answering anything that depends on the user's past, preferences or facts; add what the user \
tells you that will matter later; update or delete what has changed."""

DESCRIPTIONS = {  # when a model should reach for each tool
    "add_memory": "Remember something about the user for later conversations: a stable fact, preference, "
                  "plan or event they told you. Use infer=true to pass raw conversation text and let kvmem "
                  "extract and reconcile the facts. Do not store what only matters to this turn.",
    "search_memories": "Recall what is known about the user before answering a question that may depend on "
                       "it (preferences, people, places, past events). Ranked by meaning and words together; "
                       "narrow with metadata filters.",
    "list_memories": "Browse every stored memory of the user, newest last, page by page: to review, clean up, "
                     "or when you need all of them rather than the best matches.",
    "get_memory": "Read one memory by id, with its metadata and when it was stored.",
    "update_memory": "Correct or refresh a memory that has changed (a new address, a changed plan), rather "
                     "than adding a contradicting one.",
    "delete_memory": "Forget a memory that is wrong, outdated or that the user asks you to forget.",
    "memory_history": "See how a memory changed over time (added, updated, deleted), oldest first.",
}
READ_ONLY = {"search_memories", "list_memories", "get_memory", "memory_history"}


def build_server(backend: Backend, caller_of: Callable[[Context], Caller], *, encode: str) -> MCPServer:
    """An MCPServer with the memory tools; `encode`: how added facts get their KV (KVMem.add's)."""
    server = MCPServer("kvmem", instructions=INSTRUCTIONS)
    tools = MemoryTools(backend, caller_of, encode)
    for name, description in DESCRIPTIONS.items():
        hints = ToolAnnotations(read_only_hint=name in READ_ONLY, destructive_hint=name == "delete_memory")
        server.add_tool(getattr(tools, name), name=name, description=description, annotations=hints,
                        structured_output=True)
    return server


class HttpDoor:
    """The /mcp route and the task group it needs, for the HTTP server to mount (app.py).

    The caller's key is checked before the MCP exchange starts, so an unknown key gets the API's
    own 401, and a connection without a user a 400 naming the header."""

    def __init__(self, backend: Backend, tenant_of: TenantOf, *, host: str, path: str = "/mcp",
                 admit: Callable[[str | None], None] | None = None) -> None:
        """admit(tenant name): raises (an error with a code) to refuse the request, e.g. past the
        tenant's rate; called once per HTTP request, in a worker thread."""
        self.tenant_of = tenant_of
        self.admit = admit
        self.server = build_server(backend, lambda ctx: from_headers(ctx.headers, tenant_of), encode="background")
        self.server.streamable_http_app(stateless_http=True, json_response=True, host=host)
        self.asgi = StreamableHTTPASGIApp(self.server.session_manager)
        self.route = Route(path, endpoint=self, methods=["GET", "POST", "DELETE"])  # self: a plain ASGI app

    def running(self) -> AbstractAsyncContextManager:
        """Enter in the app's lifespan: the session manager's task group."""
        return self.server.session_manager.run()

    async def __call__(self, scope, receive, send) -> None:
        from starlette.requests import Request

        try:
            caller = from_headers(Request(scope).headers, self.tenant_of)
            if self.admit is not None:
                await run_in_threadpool(self.admit, caller.tenant.name)
        except Exception as e:  # the key ring's and the caller's errors carry a code
            if getattr(e, "code", None) is None:
                raise
            status = getattr(e, "status", 400)
            error = {"message": str(getattr(e, "message", e)), "type": "invalid_request_error",
                     "param": getattr(e, "param", None), "code": e.code}
            await JSONResponse({"error": error}, status_code=status, headers=getattr(e, "headers", None))(
                scope, receive, send)
            return
        await self.asgi(scope, receive, send)


class LocalBackend:
    """A KVMem this process opened (`kvmem mcp`): calls run in a worker thread."""

    def __init__(self, mem) -> None:
        self.mem = mem

    def require(self):
        return self.mem

    async def call(self, fn: Callable, *args, **kwargs):
        return await anyio.to_thread.run_sync(lambda: fn(*args, **kwargs))


def run_stdio(mem, caller: Caller, *, encode: str) -> None:
    """Serve the tools over stdin/stdout until the client closes them."""
    build_server(LocalBackend(mem), lambda ctx: caller, encode=encode).run("stdio")
