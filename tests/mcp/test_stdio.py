"""`kvmem mcp` over stdio, standalone on a data folder, driven by the `mcp` SDK's stdio client."""

from __future__ import annotations

import os
import sys
from contextlib import asynccontextmanager

import anyio
import pytest
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

from kvmem.config import default_home
from tests.mcp import contract
from tests.server.serverproc import KEYS

KEYRING = ",".join(f"{tenant}={key}" for tenant, key in KEYS.items())


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("mcp-stdio")


def params(home, key: str | None, *extra: str) -> StdioServerParameters:
    env = {"KVMEM_API_KEYS": KEYRING, "KVMEM_READER_ADAPTER": "off", **({"KVMEM_API_KEY": key} if key else {})}
    return StdioServerParameters(command=sys.executable, env=env, args=[
        "-m", "kvmem.cli", "mcp", "--home", str(home), "--models-home", str(default_home() / "models"),
        "--user", "alice", *extra])


@asynccontextmanager
async def session(home, tenant: str):
    with open(home / f"{tenant}.log", "a") as log:  # the server's stderr
        async with stdio_client(params(home, KEYS[tenant]), errlog=log) as (read, write):
            async with ClientSession(read, write) as s:
                await s.initialize()
                yield s


def test_every_tool_over_stdio(home):
    async def scenario():
        async with session(home, "alpha") as alpha:
            await contract.lists_the_tools(alpha)
            await contract.every_tool_round_trip(alpha)
            await contract.bad_arguments_are_named(alpha)
            # no engine in this process: infer needs an LLM, and says so as a tool error
            assert "extract" in (await contract.error(alpha, "add_memory", text="I moved to Lisbon.", infer=True))
            async with session(home, "beta") as beta:
                await contract.another_tenant_sees_nothing(alpha, beta)

    anyio.run(scenario)


def test_a_key_of_no_tenant_is_refused_before_serving(home):
    import subprocess

    p = params(home, "sk-not-a-key")
    run = subprocess.run([p.command, *p.args], env={**os.environ, **p.env}, capture_output=True, text=True,
                         timeout=120, stdin=subprocess.DEVNULL)
    assert run.returncode == 2 and "invalid API key" in run.stderr, run.stderr
    assert run.stdout == ""  # nothing on the protocol's channel
