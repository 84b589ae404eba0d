"""A LangGraph store on kvmem: `KVMemStore`, a `BaseStore` whose items are kvmem facts.

    store = KVMemStore.over_http("http://127.0.0.1:8000", api_key=KEY)     # or KVMemStore(mem=KVMem())
    store.put(("alice", "memories"), "home", {"content": "I live in Lisbon."})
    store.search(("alice",), query="Where do I live?")                     # kvmem's hybrid ranking

A namespace's first label is the kvmem user id: so what an agent stores for a user is what a chat
with `user=<that id>` retrieves and injects as KV. The rest of the namespace and the key are kept
in the fact's metadata (LABELS), beside the value's own fields, which LangGraph's `filter`
therefore reaches. The fact's text (embedded, searched, encoded) is the value's first string field
of TEXT_FIELDS, else the fields `index=[...]` names, else the value as JSON.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable
from typing import Any

from langgraph.store.base import (BaseStore, GetOp, Item, ListNamespacesOp, MatchCondition, Op, PutOp, Result,
                                  SearchItem, SearchOp)

from kvmem.errors import InvalidInputError
from kvmem.integrations.backends import Fact, InProcess, OverHttp, Scope

TEXT_FIELDS = ("content", "text", "memory", "data")
KEY, DEPTH, LEVEL = "lg_key", "lg_depth", "lg_ns"  # metadata: the key, len(namespace), lg_ns1.. its labels
OPS = {"$eq": "eq", "$ne": "ne", "$gt": "gt", "$gte": "gte", "$lt": "lt", "$lte": "lte", "$in": "in", "$nin": "nin"}
PAGE = 1000


class KVMemStore(BaseStore):
    """LangGraph's BaseStore on kvmem, in process (`mem=`) or over HTTP (`over_http`); every call is
    narrowed to `agent_id` / `run_id` when given. `encode="sync"`: put returns once the fact's KV is
    encoded, so the next chat turn injects it; "background" returns sooner."""

    def __init__(self, *, mem=None, backend=None, agent_id: str | None = None, run_id: str | None = None,
                 encode: str = "sync") -> None:
        self.backend = backend or InProcess(mem, Scope(agent_id, run_id), encode)

    @classmethod
    def over_http(cls, url: str, api_key: str | None = None, *, agent_id: str | None = None,
                  run_id: str | None = None, encode: str = "sync", timeout: float = 300) -> "KVMemStore":
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        client = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout)
        return cls(backend=OverHttp(client, Scope(agent_id, run_id), encode))

    def batch(self, ops: Iterable[Op]) -> list[Result]:
        return [self._one(op) for op in ops]

    async def abatch(self, ops: Iterable[Op]) -> list[Result]:
        """The same calls in a worker thread: kvmem's are blocking (a KVMem call, or HTTP)."""
        return await asyncio.to_thread(self.batch, list(ops))

    def _one(self, op: Op) -> Result:
        if isinstance(op, GetOp):
            fact = self._find(op.namespace, op.key)
            return _item(fact) if fact else None
        if isinstance(op, PutOp):
            return self._put(op)
        if isinstance(op, SearchOp):
            return self._search(op)
        if isinstance(op, ListNamespacesOp):
            return self._namespaces(op)
        raise InvalidInputError(f"unknown store operation {type(op).__name__}", param="op")

    def _find(self, namespace: tuple[str, ...], key: str) -> Fact | None:
        user = _user(namespace, "namespace")
        found = self.backend.list(user, {**_labels(namespace), DEPTH: len(namespace), KEY: key}, 1, 0)
        return found[0] if found else None

    def _put(self, op: PutOp) -> None:
        old = self._find(op.namespace, op.key)
        if op.value is None:
            if old:
                self.backend.delete(old.id)
            return None
        metadata = {**op.value, **_labels(op.namespace), DEPTH: len(op.namespace), KEY: op.key}
        text = _text(op.value, op.index)
        if old:
            return self.backend.update(old.id, text, metadata)
        fact_id, new = self.backend.add(_user(op.namespace, "namespace"), text, metadata)
        if not new:
            raise InvalidInputError(f"the same text is already stored for this user (fact {fact_id}); kvmem keeps "
                                    "one copy of a text per scope", param="value")
        return None

    def _search(self, op: SearchOp) -> list[SearchItem]:
        user = _user(op.namespace_prefix, "namespace_prefix")
        filters = {**_labels(op.namespace_prefix), DEPTH: "*", **_filters(op.filter)}
        if op.query:
            facts = self.backend.search(user, op.query, filters, min(op.offset + op.limit, 100))[op.offset:]
        else:
            facts = self.backend.list(user, filters, op.limit, op.offset)
        return [_item(f, SearchItem) for f in facts]

    def _namespaces(self, op: ListNamespacesOp) -> list[tuple[str, ...]]:
        found = set()
        for user in self.backend.users():
            offset = 0
            while page := self.backend.list(user, {DEPTH: "*"}, PAGE, offset):
                found.update(_item(f).namespace for f in page)
                offset += PAGE
        spaces = {ns[:op.max_depth] if op.max_depth else ns for ns in found
                  if all(_matches(ns, c) for c in op.match_conditions or ())}
        return sorted(spaces)[op.offset:op.offset + op.limit]


def _user(namespace: tuple[str, ...], param: str) -> str:
    if not namespace or not isinstance(namespace[0], str) or not namespace[0]:
        raise InvalidInputError("a namespace starts with the kvmem user id, e.g. ('alice', 'memories')", param=param)
    return namespace[0]


def _labels(namespace: tuple[str, ...]) -> dict[str, str]:
    return {f"{LEVEL}{i}": label for i, label in enumerate(namespace[1:], 1)}


def _text(value: dict, index: list[str] | bool | None) -> str:
    if isinstance(index, list) and index:
        parts = [value.get(f) for f in index]
        return " ".join(p if isinstance(p, str) else json.dumps(p) for p in parts if p is not None)
    text = next((value[f] for f in TEXT_FIELDS if isinstance(value.get(f), str) and value[f].strip()), None)
    return text or json.dumps(value, ensure_ascii=False, sort_keys=True)


def _filters(filter: dict[str, Any] | None) -> dict:
    """LangGraph's value filter ({"k": v} or {"k": {"$gte": 3}}) as kvmem's metadata filter."""
    out = {}
    for key, cond in (filter or {}).items():
        if isinstance(cond, dict):
            unknown = set(cond) - set(OPS)
            if unknown:
                raise InvalidInputError(f"filter operators {sorted(unknown)} are not supported; use {sorted(OPS)}",
                                        param=f"filter.{key}")
            cond = {OPS[op]: v for op, v in cond.items()}
        out[key] = cond
    return out


def _item(fact: Fact, cls=Item):
    meta = fact.metadata
    depth = int(meta[DEPTH])
    value = {k: v for k, v in meta.items() if k not in (KEY, DEPTH) and not _is_level(k)}
    labels = tuple(meta[f"{LEVEL}{i}"] for i in range(1, depth))
    extra = {"score": fact.score} if cls is SearchItem else {}
    return cls(value=value, key=meta[KEY], namespace=(fact.user, *labels), created_at=fact.created_at,
               updated_at=fact.updated_at, **extra)


def _is_level(key: str) -> bool:
    return key.startswith(LEVEL) and key[len(LEVEL):].isdigit()


def _matches(namespace: tuple[str, ...], cond: MatchCondition) -> bool:
    path = tuple(cond.path)
    if len(path) > len(namespace):
        return False
    part = namespace[:len(path)] if cond.match_type == "prefix" else namespace[len(namespace) - len(path):]
    return all(p == "*" or p == n for p, n in zip(path, part))
