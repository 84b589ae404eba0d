"""Reading the LLM's replies (no engine): facts, decisions by alias, and what is dropped."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import jsonschema

from kvmem.extract import prompts
from kvmem.extract.decide import Decision, aliases, parse_decisions, parse_facts
from kvmem.extract.infer import changes_of, origin_of


def test_facts_are_stripped_deduplicated_and_bounded():
    many = [f"f{i}" for i in range(20)]
    reply = json.dumps({"facts": [" Marta adopted Bruno. ", "Marta adopted Bruno.", "", 3, *many]})
    facts = parse_facts(reply)
    assert facts[0] == "Marta adopted Bruno." and len(facts) == prompts.MAX_FACTS and "" not in facts


def test_a_reply_that_does_not_parse_gives_no_facts():
    assert parse_facts('{"facts": ["cut in hal') == [] and parse_facts('{"facts": "one"}') == []


def test_decisions_map_aliases_to_real_ids_and_drop_unknown_ones():
    shown = aliases(["f-aaa", "f-bbb"])
    reply = json.dumps({"decisions": [
        {"fact": 0, "event": "UPDATE", "id": "1"},
        {"fact": 1, "event": "DELETE", "id": "7"},  # never shown: refused
        {"fact": 2, "event": "DELETE", "id": "f-aaa"},  # a real id, but not an alias: refused
        {"fact": 3, "event": "ADD", "id": ""},
        {"fact": 4, "event": "UPDATE", "id": "1"},  # the same memory twice: the first decision stands
        {"fact": 0, "event": "ADD", "id": ""},  # the same fact twice
        {"fact": 9, "event": "ADD", "id": ""},  # no such fact
        {"fact": 5, "event": "MERGE", "id": ""},
        "nonsense",
    ]})
    assert parse_decisions(reply, 6, shown) == [Decision(0, "UPDATE", "f-bbb"), Decision(3, "ADD")]
    assert parse_decisions("not json", 6, shown) == [] and parse_decisions('{"decisions": {}}', 6, shown) == []


def test_schemas_allow_only_shown_aliases_and_are_valid_schemas():
    schema = prompts.decisions_schema(2, ["0", "1"])
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.Draft202012Validator.check_schema(prompts.facts_schema())
    jsonschema.validate({"decisions": [{"fact": 1, "event": "DELETE", "id": "1"}]}, schema)
    for bad in ({"fact": 1, "event": "DELETE", "id": "2"}, {"fact": 2, "event": "ADD", "id": ""}):
        assert not jsonschema.Draft202012Validator(schema).is_valid({"decisions": [bad]})


def test_the_prompt_dates_the_conversation_from_its_last_timestamp():
    messages = [{"role": "user", "content": "I ran a marathon yesterday.", "timestamp": "2023-05-09"}]
    system, user = prompts.extraction_messages(messages)
    assert "Today is 9 May 2023" in system["content"] and "[9 May 2023] user: I ran a marathon" in user["content"]
    undated = prompts.extraction_messages([{"role": "user", "content": "Hi"}], datetime(2024, 2, 1, tzinfo=timezone.utc))
    assert "Today is 1 February 2024" in undated[0]["content"]


def test_each_change_keeps_the_message_it_came_from_as_origin():
    messages = [{"role": "user", "content": "My sister Marta adopted a puppy.", "timestamp": "2023-05-09"},
                {"role": "assistant", "content": "Lovely! What is its name?"},
                {"role": "user", "content": "Bruno, a beagle."}]
    assert origin_of("The puppy is a beagle called Bruno.", messages) is messages[2]
    changes = changes_of([Decision(1, "UPDATE", "f-x"), Decision(0, "ADD"), Decision(2, "NONE"),
                          Decision(3, "DELETE", "f-y")],
                         ["Marta adopted a puppy on 9 May 2023.", "Bruno is a beagle.", "x", "y"], messages, {"k": 1})
    assert [(c.event, c.fact_id) for c in changes] == [("ADD", None), ("UPDATE", "f-x"), ("DELETE", "f-y")]
    assert changes[0].origin == "[9 May 2023] user: My sister Marta adopted a puppy."
    assert changes[0].metadata == {"k": 1, "timestamp": "2023-05-09"}
    assert changes[0].event_time == "2023-05-09T00:00:00"
    assert changes[1].origin == "user: Bruno, a beagle." and changes[1].metadata == {"k": 1}
