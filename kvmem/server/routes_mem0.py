"""The routes Mem0's own client (`mem0ai`'s MemoryClient and AsyncMemoryClient) calls, on kvmem.

`MemoryClient(host=..., api_key=KVMEM_KEY)` sends 'Authorization: Token <key>' (tenants.py takes
it like Bearer) and talks Mem0 platform paths with their trailing slashes: /v1/ping/,
/v3/memories/add/, /v3/memories/, /v3/memories/search/, /v1/memories/{id}/ (get, update,
delete, history), /v1/entities/, /v2/entities/{type}/{name}/ and /v1/batch/. Its delete_all
sends DELETE /v1/memories/?user_id=..., which kvmem's own route (routes_memory) already answers
in a shape the client accepts, so it is not repeated here. Scopes are tenant-namespaced as in
routes_memory; a fact of another tenant answers 404 like an unknown one.

Mem0 puts the scope in `filters` ({"user_id": ...} or {"AND": [{"user_id": ...}, ...]}); kvmem
needs a user id on every scope, and has no app_id. The other filter conditions apply to the
facts' metadata (kvmem's filter language, docs/filters.md). `infer=True` has an LLM extract facts
from the messages and reconcile them with the stored ones (kvmem/extract/), as Mem0's platform
does; omitted or false (kvmem's default, unlike the platform's), messages are stored as given.
"""

from __future__ import annotations

import math
from datetime import datetime, timezone
from functools import partial
from typing import Any

from fastapi import APIRouter, Body, Query, Request

from kvmem.errors import InvalidInputError
from kvmem.facts.expiry import expires_at_of
from kvmem.facts.store import MAX_OFFSET
from kvmem.server import views
from kvmem.server.errors import ApiError, not_found
from kvmem.server.routes_memory import add_inferred
from kvmem.server.settings import SEP
from kvmem.server.tenants import CurrentTenant, Tenant

router = APIRouter(include_in_schema=False)  # a compatibility surface: /docs shows kvmem's own API

ENTITIES = ("user_id", "agent_id", "run_id", "app_id")
# Mem0 options that change which facts are meant; kvmem cannot honour them, so they are refused
# rather than dropped (dropping them would answer with the wrong facts).
UNSUPPORTED = ("categories", "start_date", "end_date")
MAX_BATCH = 1000  # Mem0's own cap on a batch


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


def _runtime(request: Request):
    rt = request.app.state.runtime
    return rt, rt.require()


def _body(body: Any) -> dict:
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", "body")
    for name in UNSUPPORTED:
        if body.get(name) is not None:
            raise _bad(f"{name} is not supported by kvmem", name)
    return body


def _split(filters: Any) -> tuple[dict, dict | None]:
    """Mem0's filters -> (entity ids, the metadata conditions left for kvmem)."""
    if filters is None:
        return {}, None
    if not isinstance(filters, dict):
        raise _bad("filters must be a JSON object", "filters")
    entity, rest = {}, {}
    for key, value in filters.items():
        if key in ENTITIES:
            entity[key] = value
        elif key == "AND" and isinstance(value, list):
            keep = []
            for cond in value:
                if isinstance(cond, dict) and len(cond) == 1 and next(iter(cond)) in ENTITIES:
                    entity.update(cond)
                else:
                    keep.append(cond)
            if keep:
                rest["AND"] = keep
        else:
            rest[key] = value
    return entity, rest or None


def _scope(body: dict, tenant: Tenant) -> tuple[dict, dict | None]:
    """The kvmem scope named by the body's top-level ids or its filters, and the remaining filters.
    An error names the id where it was given: "user_id" at the top level, "filters.user_id" inside."""
    entity, rest = _split(body.get("filters"))
    where = {key: f"filters.{key}" for key in entity}
    for key in ENTITIES:
        if body.get(key) is not None:
            entity[key], where[key] = body[key], key
    if entity.get("app_id") is not None:
        raise _bad("app_id is not supported by kvmem: scope by user_id, agent_id and run_id", where["app_id"])
    if entity.get("user_id") is None:
        raise _bad("a user_id is required (in filters): kvmem keeps every memory in a user's scope",
                   "filters.user_id")
    for key in ("agent_id", "run_id"):
        if entity.get(key) is not None and not isinstance(entity[key], str):
            raise _bad(f"{key} must be a string", where[key])
    scope = {"user_id": tenant.user_id(entity["user_id"], where["user_id"]),
             "agent_id": entity.get("agent_id"), "run_id": entity.get("run_id")}
    return scope, rest


async def _owned(rt, mem, tenant: Tenant, memory_id: str):
    record = await rt.call(mem.get, memory_id)  # UnknownFactError: 404 (errors.py)
    if not tenant.owns(record.user_id):
        raise not_found("memory")
    return record


@router.get("/v1/ping/")
async def ping(tenant: CurrentTenant) -> dict:
    """The client's key check at construction. It refuses to start without an org and a project
    (it never sends them back to memory routes): kvmem names itself and the key's tenant."""
    return {"status": "ok", "org_id": "kvmem", "project_id": tenant.name or "default", "user_email": None}


def _messages(messages: Any, timestamp: Any) -> list[dict]:
    """Mem0's messages as kvmem's: role and content kept, Mem0's unix `timestamp` dating each turn."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list of {role, content}", "messages")
    when = None
    if timestamp is not None:
        try:
            when = datetime.fromtimestamp(_number(timestamp, "timestamp"), timezone.utc).isoformat()
        except (OverflowError, OSError, ValueError):
            raise _bad("timestamp is out of range", "timestamp") from None
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or not isinstance(m.get("role"), str):
            raise _bad("each message needs a string role and content", f"messages[{i}]")
        turn = {"role": m["role"], "content": m["content"]}
        if m.get("name") is not None:
            turn["name"] = m["name"]
        if m.get("timestamp") or when:
            turn["timestamp"] = m.get("timestamp") or when
        out.append(turn)
    return out


def _number(value: Any, param: str) -> float:
    """A JSON number as a finite float: not a bool, a string or an int past float's range (pydantic's
    strict float, for these hand-checked bodies)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(f"{param} must be a number", param)
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise _bad(f"{param} must be a finite number", param)
    return number


@router.post("/v3/memories/add/")
async def add(request: Request, tenant: CurrentTenant, body: Any = Body(...)) -> dict:
    """One fact per turn, stored as given; KV encoded in the background. With infer=True, the
    facts an LLM extracts, each with its event (ADD, UPDATE with previous_memory, DELETE)."""
    body = _body(body)
    infer = body.get("infer")
    if infer is not None and not isinstance(infer, bool):
        raise _bad("infer must be true or false", "infer")
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise _bad("metadata must be a JSON object", "metadata")
    scope, _ = _scope(body, tenant)
    rt, mem = _runtime(request)
    add = partial(mem.add, _messages(body.get("messages"), body.get("timestamp")), **scope, metadata=metadata,
                  encode="background", expiration_date=body.get("expiration_date"))
    if infer:
        out = await add_inferred(rt, mem, tenant, add)
        return {**out, "results": [{**r, "data": {"memory": r["memory"]}} for r in out["results"]]}
    result = await rt.call(add)
    added = await rt.call(views.added, mem, result, tenant, "NONE")
    return {"results": [{**m, "data": {"memory": m["memory"]}} for m in added]}


def _page_url(request: Request, page: int, page_size: int) -> str:
    return str(request.url.include_query_params(page=page, page_size=page_size))


@router.post("/v3/memories/")
async def get_all(request: Request, tenant: CurrentTenant, body: Any = Body(None),
                  page: int = Query(1, ge=1), page_size: int = Query(100, ge=1, le=1000)) -> dict:
    """Mem0's paginated list: {count, next, previous, results}, pages counted from 1."""
    scope, filters = _scope(_body(body if body is not None else {}), tenant)
    offset = (page - 1) * page_size
    if offset > MAX_OFFSET:
        raise _bad(f"page is too far: (page - 1) * page_size must be at most {MAX_OFFSET}", "page")
    rt, mem = _runtime(request)
    records = await rt.call(partial(mem.get_all, **scope, filters=filters, limit=page_size, offset=offset))
    total = await rt.call(partial(mem.count, **scope, filters=filters))
    return {"count": total,
            "next": _page_url(request, page + 1, page_size) if offset + len(records) < total else None,
            "previous": _page_url(request, page - 1, page_size) if page > 1 else None,
            "results": [views.memory(r, tenant) for r in records]}


@router.post("/v3/memories/search/")
async def search(request: Request, tenant: CurrentTenant, body: Any = Body(...)) -> dict:
    body = _body(body)
    query, top_k, threshold = body.get("query"), body.get("top_k", 10), body.get("threshold")
    if not isinstance(query, str) or not query.strip():
        raise _bad("query must be a non-empty string", "query")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= 100:
        raise _bad("top_k must be an integer from 1 to 100", "top_k")
    if threshold is not None:
        threshold = _number(threshold, "threshold")
    scope, filters = _scope(body, tenant)
    rt, mem = _runtime(request)
    hits = await rt.call(partial(mem.search, query, **scope, k=top_k, filters=filters))
    scores = {h.id: h.score for h in hits if threshold is None or h.score >= threshold}
    records = await rt.call(views.records, mem, list(scores))
    return {"results": [views.memory(r, tenant, score=scores[r.id]) for r in records]}


@router.get("/v1/memories/{memory_id}/")
async def get(memory_id: str, request: Request, tenant: CurrentTenant) -> dict:
    rt, mem = _runtime(request)
    return views.memory(await _owned(rt, mem, tenant, memory_id), tenant)


def _update_args(body: dict, record, param: str = "") -> tuple[str, dict | None, dict]:
    """Mem0's update fields -> (text, metadata, extra kwargs); kvmem's update always takes a text,
    so a metadata-only change resends the stored one."""
    if body.get("timestamp") is not None:
        raise _bad("timestamp cannot be changed by an update in kvmem", f"{param}timestamp")
    text, metadata = body.get("text"), body.get("metadata")
    if text is None and metadata is None and "expiration_date" not in body:
        raise _bad("give text, metadata or expiration_date", f"{param}text")
    if text is not None and (not isinstance(text, str) or not text.strip()):
        raise _bad("text must be a non-empty string", f"{param}text")
    if metadata is not None and not isinstance(metadata, dict):
        raise _bad("metadata must be a JSON object", f"{param}metadata")
    expiry = {"expiration_date": body["expiration_date"]} if "expiration_date" in body else {}
    try:  # checked here so that a batch refuses a bad entry before applying any
        expires_at_of(expiry.get("expiration_date"))
    except InvalidInputError as e:
        raise _bad(str(e), f"{param}expiration_date") from None
    return (text if text is not None else record.text), metadata, expiry


@router.put("/v1/memories/{memory_id}/")
async def update(memory_id: str, request: Request, tenant: CurrentTenant, body: Any = Body(...)) -> dict:
    body = _body(body)
    rt, mem = _runtime(request)
    record = await _owned(rt, mem, tenant, memory_id)
    text, metadata, expiry = _update_args(body, record)
    return views.memory(await rt.call(partial(mem.update, memory_id, text, metadata, **expiry)), tenant)


@router.delete("/v1/memories/{memory_id}/")
async def delete(memory_id: str, request: Request, tenant: CurrentTenant, delete_linked: bool = False) -> dict:
    """`delete_linked` is accepted and has nothing to do: kvmem keeps no chain of superseded memories."""
    rt, mem = _runtime(request)
    await _owned(rt, mem, tenant, memory_id)
    await rt.call(mem.delete, memory_id)
    return {"message": "Memory deleted successfully!"}


@router.get("/v1/memories/{memory_id}/history/")
async def history(memory_id: str, request: Request, tenant: CurrentTenant) -> list:
    """A list (Mem0's shape), oldest event first."""
    rt, mem = _runtime(request)
    events = await rt.call(mem.history, memory_id)
    owner = await rt.call(views.owner, mem, memory_id, events)
    if owner is None or not tenant.owns(owner):
        raise not_found("memory")
    return [{**views.history_event(e), "user_id": tenant.local(owner)} for e in events]


def _tenant_scopes(mem, tenant: Tenant) -> list:
    prefix = f"{tenant.name}{SEP}" if tenant.name else ""
    return [s for s in mem.scopes(prefix) if tenant.owns(s.user_id)]


@router.get("/v1/entities/")
async def entities(request: Request, tenant: CurrentTenant) -> dict:
    """Every user, agent and run of the tenant that holds memories, with how many."""
    rt, mem = _runtime(request)
    totals: dict[tuple[str, str], int] = {}
    for s in await rt.call(_tenant_scopes, mem, tenant):
        for kind, name in (("user", tenant.local(s.user_id)), ("agent", s.agent_id), ("run", s.run_id)):
            if name is not None:
                totals[(kind, name)] = totals.get((kind, name), 0) + s.facts
    results = [{"id": name, "name": name, "type": kind, "total_memories": n, "owner": None,
                "created_at": None, "updated_at": None} for (kind, name), n in totals.items()]
    return {"count": len(results), "results": results}


def _delete_entity(mem, tenant: Tenant, kind: str, name: str) -> int:
    if kind == "user":
        return mem.delete_all(user_id=tenant.user_id(name, "name"))
    key = f"{kind}_id"
    users = {s.user_id for s in _tenant_scopes(mem, tenant) if getattr(s, key) == name}
    return sum(mem.delete_all(user_id=u, **{key: name}) for u in users)


@router.delete("/v2/entities/{kind}/{name}/")
async def delete_entity(kind: str, name: str, request: Request, tenant: CurrentTenant) -> dict:
    """Forget an entity's memories. One already empty answers 200 too: the client's reset deletes
    users before their agents and runs, which are empty by then."""
    if kind not in ("user", "agent", "run"):
        raise _bad("entity type must be user, agent or run (kvmem has no apps)", "type")
    rt, mem = _runtime(request)
    n = await rt.call(_delete_entity, mem, tenant, kind, name)
    return {"message": "Entity deleted successfully!", "deleted": n}


def _batch(body: Any) -> list[dict]:
    memories = _body(body).get("memories")
    if not isinstance(memories, list) or not 1 <= len(memories) <= MAX_BATCH:
        raise _bad(f"memories must be a list of 1 to {MAX_BATCH} objects", "memories")
    for i, m in enumerate(memories):
        if not isinstance(m, dict) or not isinstance(m.get("memory_id"), str):
            raise _bad("each entry needs a memory_id", f"memories[{i}].memory_id")
    return memories


@router.put("/v1/batch/")
async def batch_update(request: Request, tenant: CurrentTenant, body: Any = Body(...)) -> dict:
    """Every entry is checked (its id owned, its fields valid) before any is applied."""
    memories = _batch(body)
    rt, mem = _runtime(request)
    changes = []
    for i, m in enumerate(memories):
        record = await _owned(rt, mem, tenant, m["memory_id"])
        changes.append((m["memory_id"], *_update_args(m, record, f"memories[{i}].")))
    for memory_id, text, metadata, expiry in changes:
        await rt.call(partial(mem.update, memory_id, text, metadata, **expiry))
    return {"message": f"Successfully updated {len(changes)} memories"}


@router.delete("/v1/batch/")
async def batch_delete(request: Request, tenant: CurrentTenant, body: Any = Body(...)) -> dict:
    """Every id is checked before any is deleted, so an unknown one deletes nothing."""
    memories = _batch(body)
    rt, mem = _runtime(request)
    ids = list(dict.fromkeys(m["memory_id"] for m in memories))
    for memory_id in ids:
        await _owned(rt, mem, tenant, memory_id)
    for memory_id in ids:
        await rt.call(mem.delete, memory_id)
    return {"message": f"Successfully deleted {len(ids)} memories"}
