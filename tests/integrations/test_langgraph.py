"""KVMemStore against LangGraph's BaseStore contract (LangGraph ships no store conformance suite):
through a compiled graph that writes memory in one run and reads it in a later one, and call by
call, in process and over HTTP to the session's server."""

from __future__ import annotations

import asyncio
import uuid
from typing import TypedDict

import pytest
from langgraph.graph import END, START, StateGraph
from langgraph.runtime import Runtime
from langgraph.store.base import BaseStore, GetOp, PutOp, SearchOp

from kvmem.config import Config, default_home
from kvmem.errors import InvalidInputError
from kvmem.integrations.langgraph import KVMemStore
from tests.server.serverproc import KEYS


@pytest.fixture(scope="module")
def local_mem(tmp_path_factory):
    """A KVMem on its own folder without an engine: the store's in-process door needs none."""
    from kvmem.service import KVMem

    config = Config(home=tmp_path_factory.mktemp("langgraph-home"), models_home=default_home() / "models")
    with KVMem(config, start_engine=False, background=False) as mem:
        yield mem


@pytest.fixture(params=["in_process", "http"])
def store(request, local_mem) -> BaseStore:
    if request.param == "in_process":
        return KVMemStore(mem=local_mem, encode="none")
    server = request.getfixturevalue("server")
    return KVMemStore.over_http(server.url, KEYS["alpha"], encode="background")


class State(TypedDict, total=False):
    user: str
    said: str
    recalled: list[str]


def remember(state: State, runtime: Runtime) -> State:
    if state.get("said"):
        runtime.store.put((state["user"], "memories"), uuid.uuid4().hex, {"content": state["said"]})
    return {}


def recall(state: State, runtime: Runtime) -> State:
    hits = runtime.store.search((state["user"], "memories"), query="Where does the user live?", limit=3)
    return {"recalled": [h.value["content"] for h in hits]}


def test_a_compiled_graph_writes_memory_and_reads_it_in_a_later_run(store):
    builder = StateGraph(State)
    builder.add_node("remember", remember)
    builder.add_node("recall", recall)
    builder.add_edge(START, "remember")
    builder.add_edge("remember", "recall")
    builder.add_edge("recall", END)
    graph = builder.compile(store=store)
    user = f"lg-{uuid.uuid4().hex[:8]}"
    first = graph.invoke({"user": user})
    assert first["recalled"] == []
    graph.invoke({"user": user, "said": "I live in Lisbon, near the river."})
    graph.invoke({"user": user, "said": "My cat is called Pico."})
    later = graph.invoke({"user": user})
    assert later["recalled"][0] == "I live in Lisbon, near the river." and len(later["recalled"]) == 2
    assert asyncio.run(graph.ainvoke({"user": user}))["recalled"] == later["recalled"]


def test_put_get_overwrite_delete(store):
    ns = (f"lg-{uuid.uuid4().hex[:8]}", "prefs")
    store.put(ns, "food", {"content": "I love grilled sardines.", "stars": 5})
    item = store.get(ns, "food")
    assert (item.namespace, item.key, item.value) == (ns, "food", {"content": "I love grilled sardines.", "stars": 5})
    store.put(ns, "food", {"content": "I love bacalhau now.", "stars": 4})
    again = store.get(ns, "food")
    assert again.value["content"] == "I love bacalhau now." and again.created_at <= again.updated_at
    assert store.get(ns, "drink") is None and store.get((ns[0], "other"), "food") is None
    store.delete(ns, "food")
    assert store.get(ns, "food") is None


def test_search_by_prefix_filter_and_query(store):
    user = f"lg-{uuid.uuid4().hex[:8]}"
    store.put((user, "trips"), "t1", {"content": "Trip to Kyoto in April.", "year": 2024})
    store.put((user, "trips"), "t2", {"content": "Trip to Porto in June.", "year": 2026})
    store.put((user, "pets"), "p1", {"content": "My dog Biscuit loves carrots."})
    assert {i.key for i in store.search((user,))} == {"t1", "t2", "p1"}
    assert {i.key for i in store.search((user, "trips"))} == {"t1", "t2"}
    assert [i.key for i in store.search((user, "trips"), filter={"year": {"$gte": 2025}})] == ["t2"]
    hits = store.search((user,), query="What is my dog called?", limit=2)
    assert hits[0].key == "p1" and hits[0].score is not None and hits[0].score >= hits[1].score
    with pytest.raises(InvalidInputError) as e:
        store.search((user,), filter={"year": {"$regex": "20.*"}})
    assert e.value.param == "filter.year"


def test_list_namespaces_and_batch_and_async(store):
    user = f"lg-{uuid.uuid4().hex[:8]}"
    results = store.batch([PutOp((user, "a", "x"), "k1", {"content": "Alpha one."}),
                           PutOp((user, "b"), "k2", {"content": "Beta two."}),
                           GetOp((user, "b"), "k2"), SearchOp((user, "a"), None, limit=5)])
    assert results[:2] == [None, None] and results[2].value == {"content": "Beta two."}
    assert [i.key for i in results[3]] == ["k1"]
    mine = store.list_namespaces(prefix=(user,))
    assert mine == [(user, "a", "x"), (user, "b")]
    assert store.list_namespaces(prefix=(user,), max_depth=2) == [(user, "a"), (user, "b")]
    assert store.list_namespaces(prefix=(user, "*", "x")) == [(user, "a", "x")]

    async def in_async():
        await store.aput((user, "c"), "k3", {"content": "Gamma three."})
        return await store.aget((user, "c"), "k3"), await store.asearch((user, "c"))

    got, found = asyncio.run(in_async())
    assert got.value["content"] == "Gamma three." and [i.key for i in found] == ["k3"]


def test_a_namespace_needs_a_user(store):
    with pytest.raises(InvalidInputError) as e:
        store.search(())
    assert e.value.param == "namespace_prefix"
