"""One real server for the whole directory, restarted only where a test needs another queue bound.

`servers.get(bound)` returns the running server, starting one (same --data-dir) only if none is
running or its bound differs; tests marked `last` (crash, 429, shutdown) run after all others,
so a full run starts the engine twice: bound 64, then bound 4 after the crash test.
"""

from __future__ import annotations

import pytest

from tests.server.serverproc import KEYS, ServerProc, write_config

DEFAULT_BOUND = 64


def pytest_configure(config):
    config.addinivalue_line("markers", "last: run after the other server tests, in file order")


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.get_closest_marker("last") is not None)  # stable: keeps file order


class Servers:
    def __init__(self, tmp) -> None:
        self.data_dir = tmp / "data"
        self.config = write_config(tmp / "server.toml")
        self.log = tmp / "server.log"
        self.current: ServerProc | None = None
        self.first: ServerProc | None = None

    def get(self, bound: int | None = None) -> ServerProc:
        cur = self.current
        if cur is not None and cur.alive and bound in (None, cur.bound):
            return cur
        if cur is not None:
            cur.stop()
        self.current = ServerProc(self.data_dir, self.config, self.log, bound or DEFAULT_BOUND).wait_ready()
        self.first = self.first or self.current
        return self.current

    def crash(self) -> None:
        self.current.kill()
        self.current = None

    def close(self) -> None:
        """Stop the server; a later get() starts it again. Tests that start engines of their own
        (the topology's replicas) close it first: with it, the suite's engines outgrew 24 GiB."""
        if self.current is not None:
            self.current.stop()
            self.current = None


# `servers` and `server` live in tests/conftest.py: tests/mcp/ and tests/integrations/ share the one server.


@pytest.fixture
def alpha(server):
    with server.client("alpha") as c:
        yield c


@pytest.fixture
def beta(server):
    with server.client("beta") as c:
        yield c


@pytest.fixture
def openai_client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key=KEYS["alpha"], timeout=180, max_retries=0)


def assert_error(r, status: int, param: str | None = ...) -> dict:
    """The OpenAI error shape with the expected status (and param, where given)."""
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert {"message", "type", "param", "code"} <= set(error), error
    assert isinstance(error["message"], str) and error["message"]
    if param is not ...:
        assert error["param"] == param, error
    return error
