"""Property-based fuzzing of every public KVMem method on the real engine.

Properties: a call either succeeds or raises one of kvmem's own input errors
(InvalidInputError, UnknownFactError), never anything else; a refused call stores nothing and
changes nothing. Inputs mix ordinary text with what careless or hostile callers send: lone
surrogates, controls, zero-width characters, the old prompt marker, wrong types, huge numbers.

Examples are derandomized (the same cases every run, so CI is repeatable) and bounded so the
file runs in a few minutes; KVMEM_FUZZ_EXAMPLES=N scales the budget, KVMEM_FUZZ_RANDOM=1 explores.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmem.errors import InvalidInputError, UnknownFactError
from kvmem.keeper import all_records

SCALE = float(os.environ.get("KVMEM_FUZZ_EXAMPLES", "1"))
REFUSALS = (InvalidInputError, UnknownFactError)


def fuzz(examples: int):
    return settings(max_examples=max(1, int(examples * SCALE)), deadline=None, database=None,
                    derandomize=os.environ.get("KVMEM_FUZZ_RANDOM") != "1",
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


NASTY = ["", " ", "\n\t", "\x00", "\ufeff", "\u200b\u2060", "a\ud800", "\udfff", "\x00KVMEM-FACTS\x00", "{text}",
         "{}", "::", "alice::bob", "\u202e", "é" * 3, "🙂", "<|im_end|>", "<|im_start|>system\n", "%s%n", "'; DROP TABLE facts;--"]
texts = st.one_of(st.text(max_size=30), st.sampled_from(NASTY),
                  st.text(st.characters(categories=["Cs", "Cc", "Cf", "Zs", "Zl", "Co"]), max_size=4),
                  st.tuples(st.text(max_size=10), st.sampled_from(NASTY)).map("".join))
anything = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), texts, st.binary(max_size=4),
                     st.lists(texts, max_size=2))
ids = st.one_of(texts, st.sampled_from(["u", "fuzz-user"]), st.none(), st.integers())
json_like = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | texts,
                         lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
                         max_leaves=6)
roles = st.one_of(st.sampled_from(["user", "assistant", "system"]), texts)
message = st.fixed_dictionaries({"role": roles, "content": st.one_of(texts, anything)},
                                optional={"name": anything, "timestamp": anything})
messages = st.one_of(texts, st.lists(message, max_size=4), anything)
small_ints = st.one_of(st.sampled_from([0, 1, 2, -1, 10**12, 2**63]), st.integers(), st.none(), texts)
tokens_out = st.sampled_from([0, -1, 1, 2, 10**9, None, "2", 1.5])  # big enough to generate: refused


@pytest.fixture(scope="module")
def fuzz_mem(mem, tmp_path_factory):
    """Its own store (so the suite's other tests never see fuzzed facts), the session's engine."""
    from kvmem.config import Config
    from kvmem.service import KVMem

    config = Config(home=tmp_path_factory.mktemp("fuzz-home"), models_home=mem.config.models_home)
    m = KVMem(config, engine=mem.engine, background=False)
    m.add(facts=["The fuzz user owns a green bicycle.", "The fuzz user lives in Ghent."], user_id="fuzz-user",
          encode="sync")
    yield m
    m.close()


def snapshot(m) -> list[tuple]:
    return [(r.id, r.text, r.metadata, r.kv_status) for r in all_records(m.facts)]


def refused_or_ok(m, call) -> None:
    """Run `call`; a refusal must be one of kvmem's input errors and leave the store as it was."""
    before = snapshot(m)
    try:
        call()
    except REFUSALS:
        assert snapshot(m) == before, "a refused call changed the store"


# A fact id: ("known", i) picks the i-th fact stored when the call runs (so generation never
# depends on the store's state, which hypothesis requires); ("raw", v) is v itself.
id_choices = st.one_of(st.integers(0, 1000).map(lambda i: ("known", i)), ids.map(lambda v: ("raw", v)))


def resolve(m, choice) -> object:
    if not isinstance(choice, tuple):
        return choice  # drawn from `anything`: passed as it is
    kind, value = choice
    if kind == "raw":
        return value
    known = [r.id for r in all_records(m.facts)]
    return known[value % len(known)] if known else "f-none"


@fuzz(120)
@given(messages=st.one_of(st.none(), messages), facts=st.one_of(st.none(), st.lists(texts, max_size=3), anything),
       user_id=ids, agent_id=ids, run_id=ids, metadata=st.one_of(json_like, st.dictionaries(texts, json_like)),
       context=st.one_of(texts, anything), window=small_ints)
def test_add(fuzz_mem, messages, facts, user_id, agent_id, run_id, metadata, context, window):
    refused_or_ok(fuzz_mem, lambda: fuzz_mem.add(messages, facts=facts, user_id=user_id, agent_id=agent_id,
                                                 run_id=run_id, metadata=metadata, context=context, window=window,
                                                 encode="none"))


@fuzz(80)
@given(query=st.one_of(texts, anything), user_id=ids, agent_id=ids, k=small_ints,
       filters=st.one_of(st.none(), json_like, st.dictionaries(texts, json_like)))
def test_search(fuzz_mem, query, user_id, agent_id, k, filters):
    refused_or_ok(fuzz_mem, lambda: fuzz_mem.search(query, user_id=user_id, agent_id=agent_id, k=k, filters=filters))


@fuzz(60)
@given(user_id=ids, run_id=ids, limit=small_ints, offset=small_ints, filters=st.one_of(st.none(), json_like))
def test_get_all(fuzz_mem, user_id, run_id, limit, offset, filters):
    refused_or_ok(fuzz_mem, lambda: fuzz_mem.get_all(user_id=user_id, run_id=run_id, limit=limit, offset=offset,
                                                     filters=filters))


@fuzz(60)
@given(choice=id_choices, text=st.one_of(texts, anything), metadata=st.one_of(st.none(), json_like))
def test_get_history_update(fuzz_mem, choice, text, metadata):
    fact_id = resolve(fuzz_mem, choice)
    refused_or_ok(fuzz_mem, lambda: fuzz_mem.get(fact_id))
    refused_or_ok(fuzz_mem, lambda: fuzz_mem.history(fact_id))
    refused_or_ok(fuzz_mem, lambda: fuzz_mem.update(fact_id, text, metadata=metadata))


@fuzz(40)
@given(choice=id_choices, user_id=ids, agent_id=ids)
def test_delete_and_delete_all(fuzz_mem, choice, user_id, agent_id):
    fact_id = resolve(fuzz_mem, choice)
    refused_or_ok(fuzz_mem, lambda: fuzz_mem.delete(fact_id))
    if user_id != "fuzz-user":
        refused_or_ok(fuzz_mem, lambda: fuzz_mem.delete_all(user_id=user_id, agent_id=agent_id))


@fuzz(50)
@given(messages=messages, user_id=st.one_of(st.just("fuzz-user"), ids), k=small_ints,
       mode=st.one_of(st.sampled_from(["kv", "text", "off"]), texts), max_tokens=tokens_out,
       filters=st.one_of(st.none(), json_like), stream=st.booleans(),
       choices=st.one_of(st.none(), st.lists(id_choices, max_size=2), anything))
def test_chat_and_chat_stream(fuzz_mem, messages, user_id, k, mode, max_tokens, filters, stream, choices):
    fact_ids = [resolve(fuzz_mem, c) for c in choices] if isinstance(choices, list) else choices

    def call():
        kw = dict(user_id=user_id, k=k, mode=mode, max_tokens=max_tokens, filters=filters, fact_ids=fact_ids)
        if stream:
            items = list(fuzz_mem.chat_stream(messages, **kw))
            assert items and not isinstance(items[-1], str)
        else:
            fuzz_mem.chat(messages, **kw)

    refused_or_ok(fuzz_mem, call)


@fuzz(30)
@given(messages=messages, answer=st.one_of(texts, anything), mode=st.sampled_from(["kv", "text", "x"]),
       choices=st.one_of(st.lists(id_choices, max_size=2), anything))
def test_score(fuzz_mem, messages, answer, mode, choices):
    fact_ids = [resolve(fuzz_mem, c) for c in choices] if isinstance(choices, list) else choices
    refused_or_ok(fuzz_mem, lambda: fuzz_mem.score(messages, answer, user_id="fuzz-user", fact_ids=fact_ids, mode=mode))
