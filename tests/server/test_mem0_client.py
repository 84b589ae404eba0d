"""Mem0's own client package (mem0ai's MemoryClient and AsyncMemoryClient), unchanged, against kvmem serve."""

from __future__ import annotations

import asyncio
import atexit
import os
import shutil
import tempfile

import pytest

# Before mem0 is imported: it reads both at import (no telemetry; its config file not in ~).
os.environ["MEM0_TELEMETRY"] = "False"
if "MEM0_DIR" not in os.environ:
    os.environ["MEM0_DIR"] = tempfile.mkdtemp(prefix="kvmem-mem0-")
    atexit.register(shutil.rmtree, os.environ["MEM0_DIR"], ignore_errors=True)  # no folder left per run

from mem0 import AsyncMemoryClient, MemoryClient  # noqa: E402
from mem0.exceptions import MemoryNotFoundError, ValidationError  # noqa: E402

from tests.server.serverproc import KEYS  # noqa: E402

TURNS = [{"role": "user", "content": "I keep bees on the roof of my flat in Ghent."},
         {"role": "assistant", "content": "How many hives do you have?"}]


@pytest.fixture
def mem0(server):
    client = MemoryClient(host=server.url, api_key=KEYS["alpha"])
    yield client
    client.client.close()


def test_construction_pings_with_mem0s_token_scheme(server):
    client = MemoryClient(host=server.url, api_key=KEYS["beta"])
    assert client.org_id == "kvmem" and client.project_id == "beta" and client.user_email is None
    with pytest.raises(ValueError, match="401"):
        MemoryClient(host=server.url, api_key="sk-not-a-key")


def test_add_get_list_search_update_history_delete(mem0):
    user = "mem0-sync"
    added = mem0.add(TURNS, user_id=user, metadata={"topic": "bees"})["results"]
    assert [m["event"] for m in added] == ["ADD", "ADD"] and all(m["id"].startswith("f-") for m in added)
    assert added[0]["memory"] == added[0]["data"]["memory"] == f"user: {TURNS[0]['content']}"
    assert [m["event"] for m in mem0.add(TURNS[:1], filters={"user_id": user})["results"]] == ["NONE"]
    first = added[0]["id"]
    got = mem0.get(first)
    assert got["id"] == first and got["user_id"] == user and got["metadata"] == {"topic": "bees"}

    page1 = mem0.get_all(filters={"user_id": user}, page=1, page_size=1)
    assert page1["count"] == 2 and len(page1["results"]) == 1 and page1["previous"] is None and page1["next"]
    page2 = mem0.get_all(filters={"AND": [{"user_id": user}]}, page=2, page_size=1)
    assert page2["next"] is None and page2["previous"] and page2["results"][0]["id"] != page1["results"][0]["id"]
    assert mem0.get_all(filters={"user_id": user, "topic": "wasps"})["count"] == 0  # metadata condition

    hits = mem0.search("Where are the bees kept?", filters={"user_id": user}, top_k=1)["results"]
    assert len(hits) == 1 and hits[0]["id"] in {m["id"] for m in added} and isinstance(hits[0]["score"], float)
    assert mem0.search("bees", filters={"user_id": user}, threshold=1e9)["results"] == []

    updated = mem0.update(first, text="I keep bees on the roof of my flat in Antwerp.")
    assert updated["id"] == first and updated["memory"].endswith("Antwerp.")
    assert mem0.update(first, metadata={"topic": "hives"})["metadata"] == {"topic": "hives"}
    events = mem0.history(first)
    assert isinstance(events, list) and [e["event"] for e in events][:2] == ["ADD", "UPDATE"]
    assert events[1]["new_memory"].endswith("Antwerp.") and events[0]["user_id"] == user

    assert "deleted" in mem0.delete(first)["message"]
    with pytest.raises(MemoryNotFoundError):
        mem0.get(first)
    assert "deleted" in mem0.delete_all(user_id=user)["message"]
    assert mem0.get_all(filters={"user_id": user})["count"] == 0


def test_add_with_infer_returns_mem0s_results(mem0):
    """infer=True: an LLM (the served model) extracts the facts; what a 135M model keeps is not
    pinned, only Mem0's shape and that what it reports is what is stored."""
    user = "mem0-infer"
    added = mem0.add(TURNS, user_id=user, infer=True, metadata={"topic": "bees"})["results"]
    assert added and all(m["event"] in ("ADD", "NONE") and m["id"].startswith("f-") for m in added)
    assert all(m["memory"] == m["data"]["memory"] and m["metadata"]["topic"] == "bees" for m in added)
    stored = {m["id"]: m["memory"] for m in mem0.get_all(filters={"user_id": user})["results"]}
    assert stored == {m["id"]: m["memory"] for m in added}
    again = mem0.add([{"role": "user", "content": "I now keep five hives in Ghent."}], user_id=user, infer=True)
    for m in again["results"]:
        assert m["event"] in ("ADD", "UPDATE", "DELETE", "NONE") and ("previous_memory" in m) == (m["event"] == "UPDATE")
    mem0.delete_all(user_id=user)


def test_users_and_batch_update_delete(mem0, server):
    user = "mem0-batch"
    ids = [m["id"] for m in mem0.add(TURNS, user_id=user, agent_id="keeper")["results"]]
    listed = {(e["type"], e["name"]): e["total_memories"] for e in mem0.users()["results"]}
    assert listed[("user", user)] == 2 and listed[("agent", "keeper")] >= 2
    beta = MemoryClient(host=server.url, api_key=KEYS["beta"])
    assert ("user", user) not in {(e["type"], e["name"]) for e in beta.users()["results"]}  # tenants apart

    assert "2" in mem0.batch_update([{"memory_id": ids[0], "text": "Three hives."},
                                     {"memory_id": ids[1], "metadata": {"n": 3}}])["message"]
    assert mem0.get(ids[0])["memory"] == "Three hives." and mem0.get(ids[1])["metadata"] == {"n": 3}
    with pytest.raises(ValidationError, match="expiration_date"):  # checked before any is applied
        mem0.batch_update([{"memory_id": ids[0], "text": "Four hives."},
                           {"memory_id": ids[1], "expiration_date": "someday"}])
    assert mem0.get(ids[0])["memory"] == "Three hives."
    with pytest.raises(MemoryNotFoundError):  # checked before any is deleted
        mem0.batch_delete([{"memory_id": ids[0]}, {"memory_id": "f-does-not-exist"}])
    assert mem0.get(ids[0])["id"] == ids[0]
    assert "1" in mem0.batch_delete([{"memory_id": ids[0]}])["message"]
    with pytest.raises(MemoryNotFoundError):
        mem0.get(ids[0])

    mem0.delete_users(agent_id="keeper")
    assert mem0.get_all(filters={"user_id": user})["count"] == 0
    mem0.add(TURNS[:1], user_id=user)
    mem0.delete_users(user_id=user)
    assert mem0.get_all(filters={"user_id": user})["count"] == 0


def test_errors_come_back_as_the_clients_exceptions(mem0, server):
    beta = MemoryClient(host=server.url, api_key=KEYS["beta"])
    theirs = beta.add("I am beta's.", user_id="mem0-beta")["results"][0]["id"]
    for memory_id in ("f-does-not-exist", theirs):  # another tenant's fact is unknown here
        with pytest.raises(MemoryNotFoundError):
            mem0.get(memory_id)
        with pytest.raises(MemoryNotFoundError):
            mem0.update(memory_id, text="mine now")
        with pytest.raises(MemoryNotFoundError):
            mem0.delete(memory_id)
        with pytest.raises(MemoryNotFoundError):
            mem0.history(memory_id)
    assert beta.get(theirs)["memory"] == "user: I am beta's."
    with pytest.raises(ValidationError, match="infer"):
        mem0.add(TURNS, user_id="mem0-errors", infer="maybe")
    assert mem0.add(TURNS[:1], user_id="mem0-errors", infer=False)["results"][0]["event"] == "ADD"
    dated = mem0.add("We took the first honey.", user_id="mem0-errors", timestamp=1683590400)["results"][0]
    assert dated["memory"].startswith("[9 May 2023") and dated["memory"].endswith("user: We took the first honey.")
    with pytest.raises(ValidationError, match="timestamp"):
        mem0.add("When?", user_id="mem0-errors", timestamp=10**30)
    with pytest.raises(ValidationError, match="user_id"):
        mem0.get_all(filters={"agent_id": "a"})
    with pytest.raises(ValidationError, match="app_id"):
        mem0.search("bees", filters={"user_id": "mem0-errors", "app_id": "x"})
    with pytest.raises(ValidationError, match="top_k"):
        mem0.search("bees", filters={"user_id": "mem0-errors"}, top_k=0)
    with pytest.raises(ValidationError, match="start_date"):
        mem0.get_all(filters={"user_id": "mem0-errors"}, start_date="2024-01-01")
    with pytest.raises(ValidationError):
        mem0.get_all(filters={"user_id": "mem0-errors"}, page=0)
    with pytest.raises(ValidationError):
        mem0.batch_update([{"text": "no id"}])
    mem0.delete_all(user_id="mem0-errors")
    beta.delete_all(user_id="mem0-beta")


def test_async_client_round_trips(server):
    async def run():
        client = AsyncMemoryClient(host=server.url, api_key=KEYS["alpha"])
        user = "mem0-async"
        ids = [m["id"] for m in (await client.add(TURNS, user_id=user))["results"]]
        assert (await client.get(ids[0]))["memory"] == f"user: {TURNS[0]['content']}"
        listed = await client.get_all(filters={"user_id": user}, page=1, page_size=10)
        assert listed["count"] == 2 and listed["next"] is None
        hits = (await client.search("bees on the roof", filters={"user_id": user}, top_k=2))["results"]
        assert {h["id"] for h in hits} == set(ids)
        assert (await client.update(ids[0], text="No more bees."))["memory"] == "No more bees."
        assert [e["event"] for e in await client.history(ids[0])] == ["ADD", "UPDATE"]
        assert ("user", user) in {(e["type"], e["name"]) for e in (await client.users())["results"]}
        await client.batch_update([{"memory_id": ids[1], "text": "Still no bees."}])
        await client.batch_delete([{"memory_id": ids[1]}])
        await client.delete(ids[0])
        with pytest.raises(MemoryNotFoundError):
            await client.get(ids[0])
        with pytest.raises(ValidationError):
            await client.add(TURNS, user_id=user, infer="maybe")
        await client.add(TURNS[:1], user_id=user)
        assert "deleted" in (await client.delete_all(user_id=user))["message"]
        assert (await client.get_all(filters={"user_id": user}))["count"] == 0
        await client.async_client.aclose()

    asyncio.run(run())


def test_infer_with_the_extractor_down_stores_turns_for_mem0s_client(tmp_path, model_dir):
    """[extract] on_unavailable = "turns", driven by Mem0's own client over real HTTP (uvicorn in
    a thread; no engine: the extraction endpoint is a dead port): the turns are stored and the
    client sees `stored_as_turns`."""
    import threading
    import time

    import uvicorn

    from kvmem.config import Config, ExtractConfig
    from kvmem.server.app import create_app
    from kvmem.server.settings import ServerSettings
    from kvmem.service import KVMem
    from tests.server.serverproc import free_port

    config = Config(home=tmp_path / "home", models_home=model_dir.parent,
                    extract=ExtractConfig(url="http://127.0.0.1:9/v1", on_unavailable="turns"))
    mem = KVMem(config, start_engine=False)
    app = create_app(ServerSettings(api_keys={"k-down": "down"}), mem_factory=lambda: mem)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not (server.started and app.state.runtime.loaded.is_set()):
            assert time.monotonic() < deadline, app.state.runtime.error
            time.sleep(0.1)
        client = MemoryClient(host=f"http://127.0.0.1:{port}", api_key="k-down")
        out = client.add(TURNS, user_id="u", infer=True)
        assert out["stored_as_turns"] is True and [m["event"] for m in out["results"]] == ["ADD", "ADD"]
        listed = client.get_all(filters={"user_id": "u"})["results"]
        assert sorted(m["memory"] for m in listed) == sorted(m["memory"] for m in out["results"])
        client.client.close()
    finally:
        server.should_exit = True
        thread.join(timeout=30)
