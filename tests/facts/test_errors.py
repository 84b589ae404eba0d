"""Every InvalidInputError of the facts layer names its `param` (and `code`) where it is raised.

The HTTP server reports `param` without reading the message. For errors a request can cause,
it must be the field the server used to guess from the message (`legacy_guess`, a copy of
server/errors.py's old `_guess_param`), so the API's answers do not change; errors only the
Python API can cause name the argument at fault.
"""

import math

import pytest

from kvmem.errors import InvalidInputError
from kvmem.facts import FactStore, open_fact_store
from kvmem.facts.messages import check_messages, turn_facts
from kvmem.facts.scope import Scope
from kvmem.facts.text import check_fact_text, check_nested, check_unicode
from kvmem.ids import check_fact_id

ALICE = Scope("alice")


def legacy_guess(text: str) -> str | None:
    for name in ("timestamp", "origin", "messages", "message", "user_id", "agent_id", "run_id", "metadata", "filters",
                 "query", "mode", "context", "window", "limit", "offset", "facts", "fact", "filter"):
        if text.startswith(name) or f" {name}" in text:
            return {"message": "messages", "fact": "facts", "filter": "filters"}.get(name, name)
    return None


@pytest.fixture
def store(tmp_path):
    with FactStore(tmp_path / "facts.sqlite") as s:
        s.add(ALICE, "one", fact_id="taken")
        s.add(ALICE, "two", fact_id="other")
        yield s


# (call, param): calls a request can reach, through the service, whatever the backend.
REACHABLE = [
    (lambda s: s.add(ALICE, ""), "facts"),
    (lambda s: s.add(ALICE, "\u200b"), "facts"),
    (lambda s: s.add(ALICE, "a\ud800"), "facts"),
    (lambda s: s.update("other", " one "), "facts"),
    (lambda s: s.add(ALICE, "t", context=None), "context"),
    (lambda s: s.add(ALICE, "t", origin=3), "origin"),
    (lambda s: s.add(ALICE, "t", metadata=["x"]), "metadata"),
    (lambda s: s.add(ALICE, "t", metadata={"f": math.nan}), "metadata"),
    (lambda s: s.add(ALICE, "t", metadata={"t": (1, 2)}), "metadata"),
    (lambda s: s.add(ALICE, "t", metadata={"k\ud800": 1}), "metadata"),
    (lambda s: s.add(ALICE, "t", metadata={"k": ["\ud800"]}), "metadata"),
    (lambda s: s.list(user_id=""), "user_id"),
    (lambda s: s.list(user_id="u", agent_id=5), "agent_id"),
    (lambda s: s.list(user_id="u", run_id=" "), "run_id"),
    (lambda s: s.list(limit=0), "limit"),
    (lambda s: s.list(offset=-1), "offset"),
    (lambda s: s.pending(limit=0), "limit"),
    (lambda s: s.delete_scope(None), "user_id"),
    (lambda s: s.delete_scope(ALICE, agent_id="a"), "agent_id"),
    (lambda s: Scope("u\udfff"), "user_id"),
    (lambda s: Scope("u", ""), "agent_id"),
    (lambda s: Scope("u", None, 3), "run_id"),
    (lambda s: check_messages([]), "messages"),
    (lambda s: check_messages(["hello"]), "messages"),
    (lambda s: check_messages([{"role": "robot", "content": "hi"}]), "messages"),
    (lambda s: check_messages([{"role": "user", "content": 5}]), "messages"),
    (lambda s: check_messages([{"role": "user", "content": "hi \ud800"}]), "messages"),
    (lambda s: check_messages([{"role": "user", "content": "hi", "name": 3}]), "messages"),
    (lambda s: check_messages([{"role": "user", "content": "hi", "timestamp": "\ud800"}]), "timestamp"),
    (lambda s: check_messages([{"role": "user", "content": "hi", "timestamp": 5}]), "timestamp"),
    (lambda s: turn_facts([{"role": "user", "content": "hi"}], -1, "{text}"), "window"),
    (lambda s: check_fact_text("  "), "facts"),
    (lambda s: check_unicode("query", "q \ud800"), "query"),
    (lambda s: check_unicode("context", "\ud800"), "context"),
    (lambda s: check_nested("filters", {"k\ud800": 1}), "filters"),
]

# Only the Python API passes these arguments: the error names the argument.
PYTHON_ONLY = [
    (lambda s: s.add("alice", "t"), "scope"),
    (lambda s: s.add(ALICE, "t", source="chat"), "source"),
    (lambda s: s.add(ALICE, "t", position=-1), "position"),
    (lambda s: s.add(ALICE, "t", event_time="yesterday"), "event_time"),
    (lambda s: s.add(ALICE, "t", conversation_id=""), "conversation_id"),
    (lambda s: s.add(ALICE, "t", embedding=[[1.0]]), "embedding"),
    (lambda s: s.add(ALICE, "t", embedding=[1.0, math.inf]), "embedding"),
    (lambda s: s.add(ALICE, "t", fact_id="../etc"), "fact_id"),
    (lambda s: s.add(ALICE, "t", fact_id="taken"), "fact_id"),
    (lambda s: s.add_many(["x"]), "items"),
    (lambda s: s.add_many([{"scope": ALICE, "text": "x", "colour": "red"}]), "items"),
    (lambda s: s.add_many([{"text": "x"}]), "items"),
    (lambda s: s.set_kv_status("taken", "done"), "status"),
    (lambda s: check_fact_id(".hidden"), "fact_id"),
    (lambda s: open_fact_store("mysql://u:secret@host/db", "unused.sqlite"), "database_url"),
]


def raised(call, store) -> InvalidInputError:
    with pytest.raises(InvalidInputError) as e:
        call(store)
    assert e.value.code == InvalidInputError.INVALID_VALUE  # nothing in the facts layer is a 413 or 422
    return e.value


@pytest.mark.parametrize("call, param", REACHABLE)
def test_errors_a_request_can_cause_name_the_field_the_api_always_named(store, call, param):
    error = raised(call, store)
    assert error.param == param
    assert legacy_guess(str(error)) == param, str(error)


@pytest.mark.parametrize("call, param", PYTHON_ONLY)
def test_errors_of_python_only_arguments_name_the_argument(store, call, param):
    assert raised(call, store).param == param


def test_a_bad_postgresql_url_names_database_url():
    pytest.importorskip("psycopg")
    from kvmem.facts.pg import PgFactStore

    assert raised(lambda s: PgFactStore(""), None).param == "database_url"
