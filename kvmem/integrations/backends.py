"""The few memory calls the LangGraph store makes, two ways: on a KVMem in this process, or over
kvmem's HTTP API (`kvmem serve` / `kvmem gateway`, with a tenant's key). Both answer with the same
Fact, so the store above them is written once."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from kvmem.errors import InvalidInputError, UnknownFactError


@dataclass(frozen=True)
class Fact:
    id: str
    user: str  # the user id as the caller named it
    metadata: dict[str, Any]
    created_at: datetime
    updated_at: datetime
    score: float | None = None


@dataclass(frozen=True)
class Scope:
    """The agent and run every call of one store is narrowed to (the user comes from the namespace)."""

    agent_id: str | None = None
    run_id: str | None = None


def _when(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, timezone.utc)


class InProcess:
    """On a KVMem this process holds (`encode`: KVMem.add's, "sync" so the next chat injects it)."""

    def __init__(self, mem, scope: Scope, encode: str) -> None:
        self.mem, self.scope, self.encode = mem, scope, encode

    def _ids(self, user: str) -> dict:
        return {"user_id": user, "agent_id": self.scope.agent_id, "run_id": self.scope.run_id}

    @staticmethod
    def _fact(record, score: float | None = None) -> Fact:
        return Fact(record.id, record.user_id, record.metadata, _when(record.created_at), _when(record.updated_at), score)

    def add(self, user: str, text: str, metadata: dict) -> tuple[str, bool]:
        """-> (id, whether it is new): a text the scope already holds is stored once."""
        out = self.mem.add(facts=[text], **self._ids(user), metadata=metadata, encode=self.encode)
        return out.ids[0], out.created > 0

    def update(self, fact_id: str, text: str, metadata: dict) -> None:
        self.mem.update(fact_id, text, metadata)

    def delete(self, fact_id: str) -> None:
        self.mem.delete(fact_id)

    def list(self, user: str, filters: dict | None, limit: int, offset: int) -> list[Fact]:
        return [self._fact(r) for r in self.mem.get_all(**self._ids(user), filters=filters, limit=limit,
                                                        offset=offset)]

    def search(self, user: str, query: str, filters: dict | None, k: int) -> list[Fact]:
        hits = self.mem.search(query, **self._ids(user), k=k, filters=filters)
        return [self._fact(self.mem.get(h.id), h.score) for h in hits]

    def users(self) -> list[str]:
        return sorted({s.user_id for s in self.mem.scopes()})


class OverHttp:
    """On `kvmem serve` through its memory API; `client`: an httpx.Client with the base URL and key."""

    def __init__(self, client, scope: Scope, encode: str) -> None:
        self.http, self.scope, self.encode = client, scope, encode

    def _call(self, method: str, path: str, **kw) -> Any:
        r = self.http.request(method, path, **kw)
        if r.status_code == 404:
            raise UnknownFactError(path.rsplit("/", 1)[-1])
        if r.status_code >= 400:
            error = r.json().get("error", {}) if r.headers.get("content-type", "").startswith("application/json") else {}
            if r.status_code < 500 and error:
                raise InvalidInputError(error.get("message", r.text), param=error.get("param"))
            r.raise_for_status()
        return r.json()

    def _ids(self, user: str) -> dict:
        ids = {"user_id": user, "agent_id": self.scope.agent_id, "run_id": self.scope.run_id}
        return {k: v for k, v in ids.items() if v is not None}

    @staticmethod
    def _fact(m: dict) -> Fact:
        return Fact(m["id"], m["user_id"], m["metadata"], datetime.fromisoformat(m["created_at"]),
                    datetime.fromisoformat(m["updated_at"]), m.get("score"))

    def add(self, user: str, text: str, metadata: dict) -> tuple[str, bool]:
        out = self._call("POST", "/v1/memories", json={**self._ids(user), "facts": [text], "metadata": metadata,
                                                       "encode": self.encode})
        return out["results"][0]["id"], out["created"] > 0

    def update(self, fact_id: str, text: str, metadata: dict) -> None:
        self._call("PUT", f"/v1/memories/{fact_id}", json={"text": text, "metadata": metadata})

    def delete(self, fact_id: str) -> None:
        self._call("DELETE", f"/v1/memories/{fact_id}")

    def list(self, user: str, filters: dict | None, limit: int, offset: int) -> list[Fact]:
        params = {**self._ids(user), "limit": limit, "offset": offset}
        if filters:
            params["filters"] = json.dumps(filters)
        return [self._fact(m) for m in self._call("GET", "/v1/memories", params=params)["results"]]

    def search(self, user: str, query: str, filters: dict | None, k: int) -> list[Fact]:
        body = {**self._ids(user), "query": query, "limit": k, "filters": filters}
        return [self._fact(m) for m in self._call("POST", "/v1/memories/search", json=body)["results"]]

    def users(self) -> list[str]:
        return sorted(e["name"] for e in self._call("GET", "/v1/entities/")["results"] if e["type"] == "user")
