"""The MCP tools `kvmem serve` mounts at /mcp, driven by the `mcp` SDK's streamable-HTTP client
against the session's real server (the same one tests/server/ uses)."""

from __future__ import annotations

import uuid
from contextlib import asynccontextmanager

import anyio
import httpx
import httpx2
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client

from tests.mcp import contract
from tests.server.serverproc import KEYS


@asynccontextmanager
async def session(server, key: str | None, user: str, **scope: str):
    headers = {"X-Kvmem-User-Id": user, **{f"X-Kvmem-{k.title()}-Id": v for k, v in scope.items()}}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    async with httpx2.AsyncClient(headers=headers, timeout=180) as http:
        async with streamable_http_client(server.url + "/mcp", http_client=http) as (read, write):
            async with ClientSession(read, write) as s:
                await s.initialize()
                yield s


def test_every_tool_over_http(server):
    user = f"mcp-{uuid.uuid4().hex[:8]}"

    async def scenario():
        async with session(server, KEYS["alpha"], user) as alpha:
            await contract.lists_the_tools(alpha)
            fact_id = await contract.every_tool_round_trip(alpha)
            await contract.bad_arguments_are_named(alpha)
            async with session(server, KEYS["beta"], user) as beta:
                await contract.another_tenant_sees_nothing(alpha, beta)
        return fact_id

    fact_id = anyio.run(scenario)
    with server.client("alpha") as c:  # the REST API sees what the tools did, in the same tenant's scope
        assert c.get(f"/v1/memories/{fact_id}").status_code == 404
        listed = c.get("/v1/memories", params={"user_id": user}).json()
    assert "My brother lives in Oslo." in [m["memory"] for m in listed["results"]]


def test_add_with_infer_extracts_through_the_served_model(server):
    user = f"mcp-{uuid.uuid4().hex[:8]}"

    async def scenario():
        async with session(server, KEYS["alpha"], user) as alpha:
            out = await contract.call(alpha, "add_memory", text="I moved to Lisbon in May. My cat Pico came too.",
                                      infer=True)
            listed = await contract.call(alpha, "list_memories")
        return out, listed

    out, listed = anyio.run(scenario)
    assert {r["event"] for r in out["results"]} <= {"ADD", "UPDATE", "DELETE", "NONE"}
    assert listed["count"] == sum(r["event"] == "ADD" for r in out["results"])


def test_an_agent_connection_sees_its_own_agent_only(server):
    user = f"mcp-{uuid.uuid4().hex[:8]}"

    async def scenario():
        async with session(server, KEYS["alpha"], user, agent="planner") as planner:
            await contract.call(planner, "add_memory", text="The trip is booked for June.")
        async with session(server, KEYS["alpha"], user, agent="coder") as coder:
            await contract.call(coder, "add_memory", text="The repo uses Python 3.11.")
            mine = await contract.call(coder, "list_memories")
        async with session(server, KEYS["alpha"], user) as whole:
            everything = await contract.call(whole, "list_memories")
        return mine, everything

    mine, everything = anyio.run(scenario)
    assert [(m["memory"], m["agent_id"]) for m in mine["results"]] == [("The repo uses Python 3.11.", "coder")]
    assert everything["count"] == 2


def test_the_connection_is_refused_without_a_key_or_a_user(server):
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
    headers = {"Accept": "application/json, text/event-stream"}
    with httpx.Client(base_url=server.url, timeout=60) as c:
        r = c.post("/mcp", json=body, headers={**headers, "X-Kvmem-User-Id": "alice"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = c.post("/mcp", json=body, headers={**headers, "Authorization": "Bearer sk-nope", "X-Kvmem-User-Id": "a"})
        assert r.status_code == 401
        r = c.post("/mcp", json=body, headers={**headers, "Authorization": f"Bearer {KEYS['alpha']}"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "user_id"
