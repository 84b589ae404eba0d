"""What the memory API returns for a fact and a history event (Mem0's field names, plus kv_status)."""

from __future__ import annotations

from datetime import datetime, timezone

from kvmem.errors import UnknownFactError
from kvmem.server.tenants import Tenant


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).isoformat()


def memory(record, tenant: Tenant, **extra) -> dict:
    return {
        "id": record.id,
        "memory": record.text,
        "user_id": tenant.local(record.user_id),
        "agent_id": record.agent_id,
        "run_id": record.run_id,
        "metadata": record.metadata,
        "created_at": iso(record.created_at),
        "updated_at": iso(record.updated_at),
        "kv_status": record.kv_status,  # pending | encoded | failed: served as text until encoded
        "source": record.source,
        "event_time": record.event_time,
        "origin": record.origin,
        "expiration_date": iso(record.expires_at) if record.expires_at is not None else None,
        **extra,
    }


def history_event(event) -> dict:
    return {"memory_id": event.fact_id, "event": event.event, "old_memory": event.old_text,
            "new_memory": event.new_text, "created_at": iso(event.at), "source": event.source}


def records(mem, ids) -> list:
    """The facts of `ids` still stored (one deleted meanwhile is left out), for a response."""
    out = []
    for fact_id in ids:
        try:
            out.append(mem.get(fact_id))
        except UnknownFactError:
            pass
    return out


def added(mem, result, tenant: Tenant, repeat: str) -> list[dict]:
    """An add's facts still stored, each as `memory` with its event (AddResult.events: "ADD" or
    `repeat`, which is Mem0's NONE or kvmem's NOOP)."""
    stored = {r.id: r for r in records(mem, result.ids)}
    return [memory(stored[i], tenant, event=event) for i, event in result.events(repeat) if i in stored]


def owner(mem, fact_id: str, events) -> str | None:
    """The fact's stored user id; for a deleted fact, only if its history events carry it."""
    try:
        return mem.get(fact_id).user_id
    except UnknownFactError:
        return next((e.user_id for e in events if getattr(e, "user_id", None)), None)
