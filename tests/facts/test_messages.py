"""How a timestamp reads in a fact: ISO dates in words, free text as given."""

import pytest

from kvmem.facts.messages import dated, shown_time, turn_facts


@pytest.mark.parametrize("stamp, shown", [
    ("2023-05-09", "9 May 2023"),
    ("2023-05-09T18:00:00", "9 May 2023, 18:00"),
    ("2023-12-31 07:05", "31 December 2023, 07:05"),
    ("2023-05-09T18:00:00+02:00", "9 May 2023, 18:00"),
    ("1:56 pm on 8 May, 2023", "1:56 pm on 8 May, 2023"),  # LoCoMo's free text
    ("last summer", "last summer"),
])
def test_shown_time(stamp, shown):
    assert shown_time(stamp) == shown


def test_turns_and_facts_carry_their_date_in_front():
    assert dated("Maya bought a Volvo.", "2023-05-09") == "[9 May 2023] Maya bought a Volvo."
    assert dated("Maya bought a Volvo.", None) == "Maya bought a Volvo."
    turns = turn_facts([{"role": "user", "name": "Maya", "content": "I bought a Volvo!", "timestamp": "2023-05-09"},
                        {"role": "assistant", "content": "Congratulations."}], window=1, fact_template="- {text}\n")
    assert [t.text for t in turns] == ["[9 May 2023] Maya: I bought a Volvo!", "assistant: Congratulations."]
    assert turns[1].context == "- [9 May 2023] Maya: I bought a Volvo!\n"
    assert turns[0].timestamp == "2023-05-09"  # kept as given, for metadata and event_time
