"""Nested Mem0 filters through what serves them: the fact store (get_all, count, delete_all),
the dense and lexical indexes (search, each ranking) and the HTTP memory API, each against the
plain reference of tests/index/filter_reference.py. No engine: nothing here needs KV."""

from __future__ import annotations

import itertools
import json
import os

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmem.config import Config
from kvmem.errors import InvalidInputError
from kvmem.retrieval import metadata_filter
from kvmem.service import KVMem
from tests.index import filter_reference as ref

SCALE = float(os.environ.get("KVMEM_FUZZ_EXAMPLES", "1"))
_users = itertools.count()


@pytest.fixture(scope="module")
def mem(tmp_path_factory, model_dir):
    config = Config(home=tmp_path_factory.mktemp("filters-home"), models_home=model_dir.parent)
    with KVMem(config, start_engine=False) as m:
        yield m


def store(mem, metas: list[dict]) -> tuple[str, list[str]]:
    """One fact per metadata dict, under a fresh user; -> (user, ids in stored order)."""
    user = f"filters-{next(_users)}"
    ids = [mem.add(facts=[f"memo {i} of {user}"], user_id=user, metadata=meta, encode="none").ids[0]
           for i, meta in enumerate(metas)]
    return user, ids


@settings(max_examples=max(1, int(40 * SCALE)), deadline=None, database=None,
          derandomize=os.environ.get("KVMEM_FUZZ_RANDOM") != "1",
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.lists(ref.metadata, min_size=1, max_size=8), st.lists(ref.filters, min_size=1, max_size=3))
def test_get_all_search_and_delete_all_return_what_the_reference_passes(mem, drawn, flts):
    metas = drawn + ref.pool(8, seed=len(drawn))  # a mixed scope whatever hypothesis drew
    user, ids = store(mem, metas)
    for flt in flts:
        want = [i for i, meta in zip(ids, metas) if ref.passes(meta, flt)]
        assert [r.id for r in mem.get_all(user_id=user, filters=flt, limit=1000)] == want, flt
        assert mem.facts.count(user, where=metadata_filter(flt)) == len(want)
        for ranking in ("dense", "lexical", "hybrid"):
            hits = mem.search("memo", user_id=user, k=len(ids), filters=flt, ranking=ranking)
            assert {h.id for h in hits} == set(want), (ranking, flt)
    doomed = {i for i, meta in zip(ids, metas) if ref.passes(meta, flts[0])}
    assert mem.delete_all(user_id=user, filters=flts[0]) == len(doomed)
    kept = [i for i in ids if i not in doomed]
    assert [r.id for r in mem.get_all(user_id=user, limit=1000)] == kept
    for ranking in ("dense", "lexical"):  # gone from both indexes too
        assert {h.id for h in mem.search("memo", user_id=user, k=len(ids), ranking=ranking)} == set(kept)


def test_delete_all_with_filters_keeps_the_rest_of_the_scope_and_other_scopes(mem):
    user, ids = store(mem, [{"kind": "work", "n": 1}, {"kind": "home"}, {"n": 5}, {"kind": "work", "n": 9}])
    other, other_ids = store(mem, [{"kind": "work"}])
    flt = {"OR": [{"AND": [{"kind": "work"}, {"n": {"gt": 3}}]}, {"NOT": {"kind": "*"}}]}
    assert mem.delete_all(user_id=user, filters=flt) == 2
    assert [r.id for r in mem.get_all(user_id=user)] == ids[:2]
    assert [r.id for r in mem.get_all(user_id=other)] == other_ids
    for filters in ({"OR": []}, {"n": {"between": [1, 2]}}):  # refused before anything is deleted
        with pytest.raises(InvalidInputError) as err:
            mem.delete_all(user_id=user, filters=filters)
        assert err.value.param == "filters"
    assert len(mem.get_all(user_id=user)) == 2


def test_the_http_api_takes_nested_filters_on_list_search_and_delete(tmp_path, model_dir):
    from kvmem.server.app import create_app
    from kvmem.server.settings import ServerSettings

    config = Config(home=tmp_path / "home", models_home=model_dir.parent)
    app = create_app(ServerSettings(api_keys={"k1": "t1"}), config,
                     mem_factory=lambda: KVMem(config, start_engine=False))
    with TestClient(app, headers={"Authorization": "Bearer k1"}) as c:
        assert c.app.state.runtime.loaded.wait(60) and c.app.state.runtime.mem is not None
        for meta in ({"tags": ["Urgent", "q1"], "n": 1}, {"tags": ["later"], "n": 7}, {"n": 3}):
            r = c.post("/v1/memories", json={"user_id": "ana", "facts": [f"memo {meta['n']}"], "metadata": meta,
                                             "encode": "background"})
            assert r.status_code == 200, r.text
        flt = {"OR": [{"tags": {"icontains": "urgent"}}, {"AND": [{"n": {"gte": 3}}, {"NOT": {"tags": "*"}}]}]}
        listed = c.get("/v1/memories", params={"user_id": "ana", "filters": json.dumps(flt)}).json()
        assert [m["metadata"]["n"] for m in listed["results"]] == [1, 3] and listed["total"] == 2
        found = c.post("/v1/memories/search", json={"user_id": "ana", "query": "memo", "filters": flt}).json()
        assert sorted(m["metadata"]["n"] for m in found["results"]) == [1, 3]
        for bad in ("{not json", "[1]", json.dumps({"AND": {}})):
            r = c.get("/v1/memories", params={"user_id": "ana", "filters": bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "filters", r.text
        r = c.delete("/v1/memories", params={"user_id": "ana", "filters": json.dumps({"n": {"lt": 5}})})
        assert r.json()["deleted"] == 2
        assert [m["metadata"]["n"] for m in c.get("/v1/memories", params={"user_id": "ana"}).json()["results"]] == [7]
