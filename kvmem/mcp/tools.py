"""The memory tools an agent sees: add, search, list, get, update, delete, history.

Each tool reads the caller (tenant and scope) from its connection, never from its arguments, and
runs KVMem's blocking call off the event loop through the backend. kvmem's typed errors become
tool errors (is_error=True) whose text names the code and the argument at fault, so a model can
correct its call; a fact outside the caller's scope reads as unknown, as in the HTTP API.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timezone
from functools import partial
from typing import Annotated, Any, Protocol

from mcp.server.mcpserver import Context
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import Field

from kvmem.errors import KvmemError, UnknownFactError
from kvmem.mcp.caller import Caller

SCOPE_KEYS = ("user_id", "agent_id", "run_id", "app_id")

Filters = Annotated[dict[str, Any] | None, Field(description=(
    'Mem0 metadata filters, e.g. {"topic": "travel"}, {"priority": {"gte": 3}}, '
    '{"OR": [{"kind": "a"}, {"kind": "b"}]}; operators eq ne in nin gt gte lt lte contains icontains, '
    "and AND / OR / NOT. The user, agent and run come from the connection, not from filters."))]
MemoryId = Annotated[str, Field(description="a memory's id, as add_memory, search_memories or list_memories gave it")]


class Backend(Protocol):
    """Where the KVMem is: the server's Runtime (503-style error while the engine loads) or a local one."""

    def require(self): ...

    async def call(self, fn: Callable, *args, **kwargs): ...


def _iso(ts: float | None) -> str | None:
    return datetime.fromtimestamp(ts, timezone.utc).isoformat() if ts is not None else None


def view(record, caller: Caller, **extra) -> dict[str, Any]:
    """A fact as a tool returns it (the HTTP API's field names, the user id as the caller knows it)."""
    return {"id": record.id, "memory": record.text, "user_id": caller.tenant.local(record.user_id),
            "agent_id": record.agent_id, "run_id": record.run_id, "metadata": record.metadata,
            "created_at": _iso(record.created_at), "updated_at": _iso(record.updated_at),
            "kv_status": record.kv_status, **extra}


def tool_error(e: Exception) -> ToolError:
    """A kvmem error (or the server's: it carries `code` and `param` too) as the text a model reads."""
    if isinstance(e, UnknownFactError):
        return ToolError(f"not_found: memory {e.fact_id!r} not found (param: memory_id)")
    param, code = getattr(e, "param", None), getattr(e, "code", None) or "invalid_value"
    return ToolError(f"{code}: {e}" + (f" (param: {param})" if param else ""))


def metadata_filters(filters: dict | None) -> dict | None:
    """Mem0's filters minus the scope, which the connection fixes: naming it is refused, not ignored."""
    if filters is None:
        return None
    for key in SCOPE_KEYS:
        if key in filters:
            raise ToolError(f"invalid_value: the scope comes from the connection; {key} cannot be filtered on "
                            f"(param: filters.{key})")
    return filters or None


class MemoryTools:
    """The tools, bound to a backend, a way to find the caller, and how new facts get their KV."""

    def __init__(self, backend: Backend, caller_of: Callable[[Context], Caller], encode: str) -> None:
        self.backend, self.caller_of, self.encode = backend, caller_of, encode

    async def _run(self, ctx: Context, work: Callable) -> Any:
        """`work(mem, caller)` in the thread pool, kvmem's errors as tool errors."""
        try:
            caller = self.caller_of(ctx)
            mem = self.backend.require()
            return await self.backend.call(work, mem, caller)
        except ToolError:
            raise
        except (KvmemError, ValueError) as e:
            raise tool_error(e) from None
        except Exception as e:
            if getattr(e, "code", None) is None:  # not one of the server's typed errors: a bug, not the model's
                raise
            raise tool_error(e) from None

    @staticmethod
    def _owned(mem, caller: Caller, memory_id: str):
        record = mem.get(memory_id)
        if not caller.holds(record):
            raise UnknownFactError(memory_id)
        return record

    async def add_memory(self, ctx: Context,
                         text: Annotated[str, Field(description="what to remember: a fact, or a conversation "
                                                                "excerpt when infer is true")],
                         infer: Annotated[bool, Field(description="true: an LLM extracts short facts from the "
                                                                  "text and reconciles them with the stored ones "
                                                                  "(ADD, UPDATE, DELETE); false: store the text "
                                                                  "as one fact")] = False,
                         metadata: Annotated[dict[str, Any] | None, Field(description="JSON object kept with the "
                                                                                      "fact, for filters")] = None,
                         ) -> dict[str, Any]:
        def work(mem, caller: Caller) -> dict[str, Any]:
            if infer:
                return mem.add([{"role": "user", "content": text}], **caller.ids, metadata=metadata,
                               encode=self.encode, infer=True).as_mem0()
            out = mem.add(facts=[text], **caller.ids, metadata=metadata, encode=self.encode)
            return {"results": [{"id": i, "memory": text, "event": e} for i, e in out.events("NONE")]}
        return await self._run(ctx, work)

    async def search_memories(self, ctx: Context,
                              query: Annotated[str, Field(description="what you want to recall, in words")],
                              filters: Filters = None,
                              limit: Annotated[int, Field(ge=1, le=100, description="at most this many")] = 5,
                              ) -> dict[str, Any]:
        def work(mem, caller: Caller) -> dict[str, Any]:
            hits = mem.search(query, **caller.ids, k=limit, filters=metadata_filters(filters))
            records = {h.id: self._owned(mem, caller, h.id) for h in hits}
            return {"results": [view(records[h.id], caller, score=h.score) for h in hits]}
        return await self._run(ctx, work)

    async def list_memories(self, ctx: Context, filters: Filters = None,
                            limit: Annotated[int, Field(ge=1, le=1000)] = 50,
                            offset: Annotated[int, Field(ge=0)] = 0) -> dict[str, Any]:
        def work(mem, caller: Caller) -> dict[str, Any]:
            f = metadata_filters(filters)
            records = mem.get_all(**caller.ids, filters=f, limit=limit, offset=offset)
            return {"count": mem.count(**caller.ids, filters=f), "results": [view(r, caller) for r in records]}
        return await self._run(ctx, work)

    async def get_memory(self, ctx: Context, memory_id: MemoryId) -> dict[str, Any]:
        return await self._run(ctx, lambda mem, caller: view(self._owned(mem, caller, memory_id), caller))

    async def update_memory(self, ctx: Context, memory_id: MemoryId,
                            text: Annotated[str, Field(description="the memory's new text")],
                            metadata: Annotated[dict[str, Any] | None, Field(
                                description="new metadata (replaces the old); omitted: kept")] = None) -> dict[str, Any]:
        def work(mem, caller: Caller) -> dict[str, Any]:
            self._owned(mem, caller, memory_id)
            return view(mem.update(memory_id, text, metadata), caller)
        return await self._run(ctx, work)

    async def delete_memory(self, ctx: Context, memory_id: MemoryId) -> dict[str, Any]:
        def work(mem, caller: Caller) -> dict[str, Any]:
            self._owned(mem, caller, memory_id)
            mem.delete(memory_id)
            return {"id": memory_id, "deleted": True}
        return await self._run(ctx, work)

    async def memory_history(self, ctx: Context, memory_id: MemoryId) -> dict[str, Any]:
        def work(mem, caller: Caller) -> dict[str, Any]:
            events = mem.history(memory_id)
            try:
                self._owned(mem, caller, memory_id)
            except UnknownFactError:  # deleted (its events say whose it was), or not the caller's
                if not events or not caller.is_user(next((e.user_id for e in events if e.user_id), None)):
                    raise
                if caller.scope.agent_id or caller.scope.run_id:  # the events do not say which agent or run
                    raise
            return {"results": [{"event": e.event, "old_memory": e.old_text, "new_memory": e.new_text,
                                 "created_at": _iso(e.at)} for e in events]}
        return await self._run(ctx, work)
