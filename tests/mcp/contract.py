"""What every MCP door must do, driven through the `mcp` SDK's ClientSession (stdio or HTTP)."""

from __future__ import annotations

import json
from contextlib import AbstractAsyncContextManager
from typing import Callable

from mcp import ClientSession

TOOLS = {"add_memory", "search_memories", "list_memories", "get_memory", "update_memory", "delete_memory",
         "memory_history"}
Open = Callable[[str], AbstractAsyncContextManager[ClientSession]]  # tenant -> an initialized session


async def call(session: ClientSession, name: str, **arguments) -> dict:
    """A tool's structured result; fails the test if the call was a tool error."""
    result = await session.call_tool(name, arguments)
    assert not result.is_error, result.content
    return result.structured_content


async def error(session: ClientSession, name: str, **arguments) -> str:
    """A tool error's text; fails the test if the call succeeded."""
    result = await session.call_tool(name, arguments)
    assert result.is_error, result.structured_content
    return result.content[0].text


async def lists_the_tools(session: ClientSession) -> None:
    tools = {t.name: t for t in (await session.list_tools()).tools}
    assert set(tools) == TOOLS
    assert all(len(t.description) > 60 for t in tools.values())  # says when to use it, not just what
    assert tools["search_memories"].annotations.read_only_hint and not tools["add_memory"].annotations.read_only_hint
    assert {"query", "filters", "limit"} <= set(tools["search_memories"].input_schema["properties"])
    assert "user_id" not in tools["add_memory"].input_schema["properties"]  # the scope is the connection's


async def every_tool_round_trip(session: ClientSession) -> str:
    """add, search (with filters), list, get, update, history, delete; -> the id (deleted at the end)."""
    added = await call(session, "add_memory", text="I keep bees on my roof.", metadata={"topic": "hobby"})
    ((fact_id, event),) = [(r["id"], r["event"]) for r in added["results"]]
    assert event == "ADD"
    await call(session, "add_memory", text="My brother lives in Oslo.", metadata={"topic": "family"})
    hits = (await call(session, "search_memories", query="What do I keep on my roof?", limit=2))["results"]
    assert hits[0]["id"] == fact_id and hits[0]["score"] > hits[-1]["score"]
    only = await call(session, "search_memories", query="roof bees", filters={"topic": "family"})
    assert [h["memory"] for h in only["results"]] == ["My brother lives in Oslo."]
    listed = await call(session, "list_memories")
    assert listed["count"] == 2 and {r["id"] for r in listed["results"]} >= {fact_id}
    assert (await call(session, "get_memory", memory_id=fact_id))["metadata"] == {"topic": "hobby"}
    updated = await call(session, "update_memory", memory_id=fact_id, text="I keep two hives of bees on my roof.")
    assert updated["memory"] == "I keep two hives of bees on my roof."
    events = (await call(session, "memory_history", memory_id=fact_id))["results"]
    assert [e["event"] for e in events] == ["ADD", "UPDATE"]
    assert (await call(session, "delete_memory", memory_id=fact_id))["deleted"] is True
    assert "not_found" in await error(session, "get_memory", memory_id=fact_id)
    assert [e["event"] for e in (await call(session, "memory_history", memory_id=fact_id))["results"]][-1] == "DELETE"
    return fact_id


async def bad_arguments_are_named(session: ClientSession) -> None:
    assert "limit" in await error(session, "search_memories", query="bees", limit="many")
    assert "limit" in await error(session, "search_memories", query="bees", limit=0)
    assert "filters" in await error(session, "search_memories", query="bees", filters={"topic": {"regex": "b.*"}})
    assert "filters.user_id" in await error(session, "list_memories", filters={"user_id": "someone-else"})
    assert "query" in await error(session, "search_memories", query="   ")
    assert "text" in await error(session, "add_memory")
    assert "memory_id" in await error(session, "get_memory", memory_id="f-nope")


async def another_tenant_sees_nothing(mine: ClientSession, theirs: ClientSession) -> None:
    """Same user id, another tenant's key: nothing listed, found, read, changed or deleted."""
    ((fact_id, _),) = [(r["id"], r) for r in (await call(mine, "add_memory", text="My PIN is 4321."))["results"]]
    assert (await call(theirs, "list_memories"))["count"] == 0
    assert (await call(theirs, "search_memories", query="What is my PIN?"))["results"] == []
    for tool, extra in (("get_memory", {}), ("update_memory", {"text": "hacked"}), ("delete_memory", {}),
                        ("memory_history", {})):
        assert "not_found" in await error(theirs, tool, memory_id=fact_id, **extra)
    assert (await call(mine, "get_memory", memory_id=fact_id))["memory"] == "My PIN is 4321."


def text_of(result) -> dict:
    return json.loads(result.content[0].text)
