"""add(messages, infer=True) on the real engine (the session's SmolLM2-135M): extraction under the
schema, the flow end to end, and the decisions applied all or nothing (given directly, so that
what a 135M model happens to decide does not make the tests flaky)."""

from __future__ import annotations

import json
import uuid

import jsonschema
import numpy as np
import pytest

from kvmem.errors import UnknownFactError
from kvmem.extract import prompts
from kvmem.extract.infer import Inferrer
from kvmem.extract.llm import EngineLLM, ExtractorUnavailable, OpenAILLM
from kvmem.facts import changes as store_changes
from kvmem.facts.scope import Scope
from kvmem.writes import Change, apply_changes
from tests.helpers import add_fact

CONVERSATION = [
    {"role": "user", "content": "My sister Marta adopted a puppy yesterday. She named it Bruno.",
     "timestamp": "2023-05-09"},
    {"role": "assistant", "content": "How lovely! What breed is it?"},
    {"role": "user", "content": "A beagle. I live in Porto, by the way.", "timestamp": "2023-05-09"},
]


def _user(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


class Scripted:
    """An LLM test double: it extracts `facts` and decides with `decide({memory text: alias})`
    (the engine is real elsewhere: this only pins what the model would have said)."""

    def __init__(self, facts: list[str], decide) -> None:
        self.facts, self.decide, self.asked = facts, decide, []

    def complete(self, messages, schema, *, name, max_tokens, user_id):
        self.asked.append((name, messages, schema))
        if name == "facts":
            return json.dumps({"facts": self.facts})
        stored = messages[1]["content"].split("Stored memories: ")[1].split("\nNew facts:")[0]
        return json.dumps({"decisions": self.decide({m["text"]: m["id"] for m in json.loads(stored)})})


def snapshot(mem, user_id: str, ids: list[str]) -> dict:
    """Everything an add could change for this user: facts (vectors included), history, indexes, blobs."""
    facts = [(f.id, f.text, f.metadata, f.origin, f.kv_status, f.updated_at, f.embedding.tobytes())
             for f in mem.get_all(user_id=user_id)]
    history = {i: [(e.event, e.old_text, e.new_text, e.at) for e in mem.history(i)] for i in ids}
    search = [h.id for h in mem.search("puppy Porto Lisbon beagle", user_id=user_id, k=10)]
    blobs = {i: (mem.kv.get(i).token_ids if mem.kv.exists(i) else None) for i in ids}
    return {"facts": facts, "history": history, "search": search, "blobs": blobs, "count": mem.count(user_id=user_id)}


# -- through the real model -----------------------------------------------------------------------


def test_extraction_with_the_bundled_model_is_schema_valid(mem):
    schema = prompts.facts_schema()
    reply = EngineLLM(mem.chats).complete(prompts.extraction_messages(CONVERSATION), schema, name="facts",
                                          max_tokens=prompts.max_tokens_for(schema), user_id=_user("x"))
    jsonschema.validate(json.loads(reply), schema)
    assert mem.inferrer.extract(CONVERSATION, Scope(_user("x")))  # the model found something to keep


def test_add_with_infer_end_to_end(mem):
    """Validity and shape only: what a 135M model extracts and decides is not pinned."""
    user = _user("infer-e2e")
    first = mem.add(CONVERSATION, user_id=user, infer=True, encode="sync", metadata={"topic": "pets"})
    assert first.results and {c.event for c in first.results} <= {"ADD", "NONE"}  # nothing stored to reconcile
    for change in first.results:
        fact = mem.get(change.id)
        assert fact.text == change.memory and fact.metadata["source"] == "infer" and fact.metadata["topic"] == "pets"
        assert fact.origin and any(m["content"] in fact.origin for m in CONVERSATION)
        assert fact.kv_status == "encoded" and mem.history(change.id)[0].event == "ADD"
        assert mem.history(change.id)[0].source == "infer"
    second = mem.add([{"role": "user", "content": "Marta's puppy Bruno is now two years old."}], user_id=user,
                     infer=True, encode="sync")
    shape = second.as_mem0()
    assert set(shape) == {"results"}
    for item in shape["results"]:
        assert item["event"] in ("ADD", "UPDATE", "DELETE", "NONE") and item["id"].startswith("f-")
        assert ("previous_memory" in item) == (item["event"] == "UPDATE")
    assert mem.count(user_id=user) >= 1


def test_infer_refuses_facts_given_as_they_are(mem):
    with pytest.raises(Exception, match="infer") as e:
        mem.add(facts=["I like tea."], user_id=_user("x"), infer=True)
    assert e.value.param == "facts"


# -- the decisions, given -------------------------------------------------------------------------


def test_update_changes_the_fact_its_vector_and_its_blob_and_writes_history(mem):
    user = _user("infer-update")
    old = add_fact(mem, user, "I live in Porto.")
    old_blob = mem.kv.get(old.id).token_ids
    new_text = "The user moved from Porto to Lisbon in May 2023."
    results, report = apply_changes(mem.writes, [Change("UPDATE", new_text, old.id, origin="user: I moved to Lisbon.")],
                                    Scope(user), encode="sync")
    assert [c.as_mem0() for c in results] == [{"id": old.id, "memory": new_text, "event": "UPDATE",
                                               "previous_memory": "I live in Porto."}]
    fact = mem.get(old.id)
    assert fact.text == new_text and fact.origin == "user: I moved to Lisbon." and fact.metadata == {"source": "infer"}
    assert not np.array_equal(fact.embedding, old.embedding)
    assert np.allclose(fact.embedding, mem.retrieval.vectors([new_text], [""], [fact.origin])[0])
    assert report.encoded == 1 and fact.kv_status == "encoded"
    blob = mem.kv.get(old.id).token_ids
    assert blob != old_blob and blob == mem.prompts.fact_tokens(new_text)
    assert [(e.event, e.old_text, e.new_text, e.source) for e in mem.history(old.id)] == [
        ("ADD", None, "I live in Porto.", None), ("UPDATE", "I live in Porto.", new_text, "infer")]
    assert mem.search("Lisbon", user_id=user, k=1, ranking="lexical")[0].id == old.id


def test_delete_forgets_the_fact_fully(mem):
    user = _user("infer-delete")
    gone, kept = add_fact(mem, user, "I am vegetarian."), add_fact(mem, user, "I have a beagle.")
    results, _ = apply_changes(mem.writes, [Change("DELETE", fact_id=gone.id)], Scope(user), encode="sync")
    assert [c.as_mem0() for c in results] == [{"id": gone.id, "memory": "I am vegetarian.", "event": "DELETE"}]
    with pytest.raises(UnknownFactError):
        mem.get(gone.id)
    assert not mem.kv.exists(gone.id) and mem.blob(gone.id).tier is None
    assert [h.id for h in mem.search("vegetarian", user_id=user, k=5)] == [kept.id]
    assert [(e.event, e.old_text, e.new_text, e.source) for e in mem.history(gone.id)] == [
        ("ADD", None, None, None), ("DELETE", None, None, "infer")]  # the decision's source, on a delete too


def test_an_unknown_or_foreign_id_changes_nothing(mem):
    user, other = _user("infer-mine"), _user("infer-other")
    mine, theirs = add_fact(mem, user, "I live in Porto."), add_fact(mem, other, "I live in Braga.")
    agents = mem.get(mem.add(facts=["I live in Faro."], user_id=user, agent_id="a1", encode="sync").ids[0])
    before = snapshot(mem, user, [mine.id, agents.id]), snapshot(mem, other, [theirs.id])
    changes = [Change("UPDATE", "I live in Lisbon.", theirs.id), Change("DELETE", fact_id=theirs.id),
               Change("DELETE", fact_id=agents.id),  # the user's, but another scope (agent a1)
               Change("UPDATE", "I live in Lisbon.", "f-" + "0" * 32), Change("DELETE", fact_id="not an id")]
    results, _ = apply_changes(mem.writes, changes, Scope(user), encode="sync")
    assert results == []
    assert (snapshot(mem, user, [mine.id, agents.id]), snapshot(mem, other, [theirs.id])) == before


def test_an_alias_the_model_invents_is_refused(mem):
    user = _user("infer-alias")
    mine = add_fact(mem, user, "I live in Porto.")
    before = snapshot(mem, user, [mine.id])
    llm = Scripted(["The user lives in Lisbon."], lambda shown: [{"fact": 0, "event": "DELETE", "id": "5"}])
    result = Inferrer(llm, mem.retrieval, mem.facts, mem.writes).add(
        [{"role": "user", "content": "I live in Lisbon now."}], Scope(user), encode="sync")
    assert result.results == () and snapshot(mem, user, [mine.id]) == before
    (_, messages, schema), = [a for a in llm.asked if a[0] == "decisions"]
    assert mine.id not in json.dumps(messages)  # the model saw an alias, never the id
    assert schema["properties"]["decisions"]["items"]["properties"]["id"]["enum"] == ["", "0"]


def test_decisions_through_the_inferrer_apply_as_decided(mem):
    user = _user("infer-decided")
    porto, veg = add_fact(mem, user, "I live in Porto."), add_fact(mem, user, "I am vegetarian.")
    llm = Scripted(["The user lives in Lisbon.", "The user eats fish.", "The user has a cat."],
                   lambda shown: [{"fact": 0, "event": "UPDATE", "id": shown["I live in Porto."]},
                                  {"fact": 1, "event": "DELETE", "id": shown["I am vegetarian."]},
                                  {"fact": 2, "event": "ADD", "id": ""}])
    said = "I moved to Lisbon, I eat fish now and I got a cat."
    result = Inferrer(llm, mem.retrieval, mem.facts, mem.writes).add([{"role": "user", "content": said}],
                                                                     Scope(user), encode="sync")
    events = {c.event: c for c in result.results}
    assert set(events) == {"UPDATE", "DELETE", "ADD"}
    assert events["UPDATE"].id == porto.id and mem.get(porto.id).text == "The user lives in Lisbon."
    assert events["UPDATE"].previous_memory == "I live in Porto." and mem.get(porto.id).origin == f"user: {said}"
    assert events["DELETE"].id == veg.id and not mem.kv.exists(veg.id)
    added = mem.get(events["ADD"].id)
    assert added.origin == f"user: {said}" and added.kv_status == "encoded"


# -- all or nothing -------------------------------------------------------------------------------


@pytest.mark.parametrize("fails", ["UPDATE", "DELETE"])
def test_a_fault_between_decisions_leaves_the_store_as_it_was(mem, monkeypatch, fails):
    user = _user("infer-fault")
    a, b = add_fact(mem, user, "I live in Porto."), add_fact(mem, user, "I am vegetarian.")
    before = snapshot(mem, user, [a.id, b.id])
    step = store_changes.STEPS[fails]

    def faulty(*args):
        step(*args)  # its write is made, then the batch fails before the next one
        raise OSError("disk full")

    monkeypatch.setitem(store_changes.STEPS, fails, faulty)
    changes = [Change("ADD", "The user has a cat."), Change("UPDATE", "I live in Lisbon.", a.id),
               Change("DELETE", fact_id=b.id), Change("ADD", "The user eats fish.")]
    with pytest.raises(OSError):
        apply_changes(mem.writes, changes, Scope(user), encode="sync")
    assert snapshot(mem, user, [a.id, b.id]) == before
    assert {h.id for h in mem.search("cat fish Lisbon", user_id=user, k=10)} <= {a.id, b.id}


def test_an_extractor_that_is_down_stores_nothing(mem):
    user = _user("infer-down")
    kept = add_fact(mem, user, "I live in Porto.")
    before = snapshot(mem, user, [kept.id])
    down = OpenAILLM("http://127.0.0.1:9/v1", model="m", timeout_s=5)  # port 9 (discard): nothing listens
    with pytest.raises(ExtractorUnavailable) as e:
        Inferrer(down, mem.retrieval, mem.facts, mem.writes).add(CONVERSATION, Scope(user))
    assert e.value.param == "infer" and e.value.code == "extractor_unavailable"
    assert snapshot(mem, user, [kept.id]) == before
