"""The Mem0-shaped memory API under /v1/memories, every scope namespaced by the caller's tenant.

A fact id that is unknown or belongs to another tenant answers 404, the same way. An add with
`infer: true` has an LLM extract facts from the messages and reconcile them with the stored ones
(kvmem/extract/); it answers Mem0's {"results": [{"id", "memory", "event", ...}]}, and 503 with
nothing stored when the extraction LLM is unreachable.
"""

from __future__ import annotations

import json
from functools import partial

from fastapi import APIRouter, Query, Request

from kvmem.extract.llm import ExtractorUnavailable
from kvmem.facts.store import MAX_OFFSET
from kvmem.server import views
from kvmem.server.errors import ApiError, not_found
from kvmem.server.schemas import AddMemories, SearchMemories, UpdateMemory
from kvmem.server.tenants import CurrentTenant, Tenant

router = APIRouter(prefix="/v1/memories")


class AddMemoriesBody(AddMemories):
    infer: bool = False  # Mem0's: an LLM extracts facts from `messages` and reconciles them (ADD/UPDATE/DELETE)


def _runtime(request: Request):
    rt = request.app.state.runtime
    return rt, rt.require()


async def _owned(rt, mem, tenant: Tenant, fact_id: str):
    record = await rt.call(mem.get, fact_id)
    if not tenant.owns(record.user_id):
        raise not_found("memory")
    return record


@router.post("")
@router.post("/", include_in_schema=False)
async def add_memories(body: AddMemoriesBody, request: Request, tenant: CurrentTenant) -> dict:
    """Store facts now (searchable at once); their KV is encoded in the background unless encode='sync'.
    With `infer`, the facts an LLM extracts from `messages`, reconciled with the stored ones."""
    rt, mem = _runtime(request)
    if (body.messages is None) == (body.facts is None):
        raise ApiError(400, "give either messages or facts", param="messages", code="invalid_value")
    messages = body.messages
    if isinstance(messages, list):
        messages = [m.model_dump(exclude_none=True) for m in messages]
    add = partial(mem.add, messages, facts=body.facts, user_id=tenant.user_id(body.user_id),
                  agent_id=body.agent_id, run_id=body.run_id, metadata=body.metadata, window=body.window,
                  encode=body.encode, timestamp=body.timestamp, origin=body.origin,
                  expiration_date=body.expiration_date)
    if body.infer:
        return await add_inferred(rt, mem, tenant, add)
    result = await rt.call(add)
    results = await rt.call(views.added, mem, result, tenant, "NOOP")
    return {"results": results, "created": result.created, "duplicates": result.duplicates}


async def add_inferred(rt, mem, tenant: Tenant, add: partial) -> dict:
    """Run `add` with infer=True -> {"results": Mem0's results}: each fact with its event (and
    previous_memory for an UPDATE); a stored one with the fields of views.memory, a deleted one
    its id and text. `"stored_as_turns": true` when the LLM was down and [extract]
    on_unavailable = "turns" stored the messages as they came."""
    try:
        result = await rt.call(partial(add, infer=True))
    except ExtractorUnavailable as e:
        raise ApiError(503, str(e), type="server_error", param=e.param, code=e.code) from None
    records = {r.id: r for r in await rt.call(views.records, mem, [c.id for c in result.results])}
    results = [{**(views.memory(records[c.id], tenant) if c.id in records and c.event != "DELETE" else {}),
                **c.as_mem0()} for c in result.results]
    return {"results": results, **({"stored_as_turns": True} if result.stored_as_turns else {})}


FILTERS_QUERY = Query(None, description='metadata filters as a JSON object, e.g. {"OR": [{"a": 1}, {"b": "*"}]}')


def _filters(text: str | None) -> dict | None:
    """The `filters` query parameter: a JSON object (docs/filters.md), or absent."""
    if text is None:
        return None
    try:
        filters = json.loads(text)
    except ValueError:
        raise ApiError(400, "filters must be a JSON object", param="filters", code="invalid_value") from None
    if not isinstance(filters, dict):
        raise ApiError(400, f"filters must be a JSON object, got {type(filters).__name__}", param="filters",
                       code="invalid_value")
    return filters


@router.get("")
@router.get("/", include_in_schema=False)
async def list_memories(request: Request, tenant: CurrentTenant, user_id: str, agent_id: str | None = None,
                        run_id: str | None = None, limit: int = Query(100, ge=1, le=1000),
                        offset: int = Query(0, ge=0, le=MAX_OFFSET), filters: str | None = FILTERS_QUERY) -> dict:
    rt, mem = _runtime(request)
    scope, conditions = {"user_id": tenant.user_id(user_id), "agent_id": agent_id, "run_id": run_id}, _filters(filters)
    records = await rt.call(partial(mem.get_all, **scope, filters=conditions, limit=limit, offset=offset))
    total = await rt.call(partial(mem.count, **scope, filters=conditions))
    return {"results": [views.memory(r, tenant) for r in records], "total": total, "limit": limit, "offset": offset}


@router.delete("")
@router.delete("/", include_in_schema=False)
async def delete_scope(request: Request, tenant: CurrentTenant, user_id: str, agent_id: str | None = None,
                       run_id: str | None = None, filters: str | None = FILTERS_QUERY) -> dict:
    rt, mem = _runtime(request)
    n = await rt.call(partial(mem.delete_all, user_id=tenant.user_id(user_id), agent_id=agent_id, run_id=run_id,
                              filters=_filters(filters)))
    return {"deleted": n, "message": f"{n} memories deleted"}


@router.post("/search")
async def search_memories(body: SearchMemories, request: Request, tenant: CurrentTenant) -> dict:
    rt, mem = _runtime(request)
    hits = await rt.call(partial(mem.search, body.query, user_id=tenant.user_id(body.user_id), agent_id=body.agent_id,
                                 run_id=body.run_id, k=body.limit, filters=body.filters))
    scores = {h.id: h.score for h in hits}
    records = await rt.call(views.records, mem, [h.id for h in hits])
    return {"results": [views.memory(r, tenant, score=scores[r.id]) for r in records]}


@router.get("/{memory_id}")
async def get_memory(memory_id: str, request: Request, tenant: CurrentTenant) -> dict:
    rt, mem = _runtime(request)
    return views.memory(await _owned(rt, mem, tenant, memory_id), tenant)


@router.put("/{memory_id}")
async def update_memory(memory_id: str, body: UpdateMemory, request: Request,
                        tenant: CurrentTenant) -> dict:
    """New text is re-embedded and re-encoded; the old KV is dropped at once."""
    rt, mem = _runtime(request)
    await _owned(rt, mem, tenant, memory_id)
    expiry = {"expiration_date": body.expiration_date} if "expiration_date" in body.model_fields_set else {}
    return views.memory(await rt.call(partial(mem.update, memory_id, body.text, metadata=body.metadata, **expiry)),
                        tenant)


@router.delete("/{memory_id}")
async def delete_memory(memory_id: str, request: Request, tenant: CurrentTenant) -> dict:
    rt, mem = _runtime(request)
    await _owned(rt, mem, tenant, memory_id)
    await rt.call(mem.delete, memory_id)
    return {"id": memory_id, "deleted": True, "message": "memory deleted"}


@router.get("/{memory_id}/history")
async def memory_history(memory_id: str, request: Request, tenant: CurrentTenant) -> dict:
    rt, mem = _runtime(request)
    events = await rt.call(mem.history, memory_id)
    owner = await rt.call(views.owner, mem, memory_id, events)
    if owner is None or not tenant.owns(owner):
        raise not_found("memory")
    return {"results": [views.history_event(e) for e in events]}
