"""The client API on the real engine: encoding in batches, and bad input getting typed errors."""

from __future__ import annotations

import pytest

from kvmem.errors import InvalidInputError, UnknownFactError


def test_encoding_many_facts_writes_one_verified_blob_each(mem):
    facts = [mem.add_fact("batch", f"Fact number {i}: the user's locker code ends in {i:02d}.") for i in range(40)]
    report = mem.encode([f.id for f in facts])
    assert report.encoded == 40 and report.failed == ()
    for f in facts:
        blob = mem.store.get(f.id)
        assert blob.token_ids == f.tokens
        assert blob.key.shape == (mem.model.num_layers, len(f.tokens), mem.model.num_kv_heads, mem.model.head_size)
    print(f"\nencoded 40 facts in {report.seconds:.2f} s ({40 / report.seconds:.1f} facts/s)")


@pytest.mark.parametrize("text", ["", "   \n", None, 42])
def test_empty_or_non_string_fact_is_refused(mem, text):
    with pytest.raises(InvalidInputError, match="non-empty string"):
        mem.add_fact("bad-input", text)


def test_missing_user_is_refused(mem):
    with pytest.raises(InvalidInputError, match="user_id"):
        mem.add_fact("", "A fact.")


def test_unknown_fact_id_is_refused(mem):
    with pytest.raises(UnknownFactError, match="unknown fact id 'f-nope'"):
        mem.chat("bad-input", "Hi", ["f-nope"])
    with pytest.raises(UnknownFactError):
        mem.encode(["f-nope"])


def test_bad_mode_is_refused(mem):
    with pytest.raises(InvalidInputError, match="mode must be one of"):
        mem.chat("bad-input", "Hi", [], mode="telepathy")


def test_another_users_fact_is_refused(mem):
    f = mem.add_fact("owner", "The owner's secret is 42.")
    with pytest.raises(InvalidInputError, match="do not belong"):
        mem.chat("intruder", "What is the secret?", [f.id])


def test_prompt_that_cannot_fit_is_refused(mem):
    with pytest.raises(InvalidInputError, match="exceeds"):
        mem.chat("bad-input", "word " * 5000, [])
    with pytest.raises(InvalidInputError, match="does not fit"):
        mem.add_fact("bad-input", "word " * 5000)


def test_chat_without_facts_still_answers_in_both_modes(mem):
    for mode in ("text", "kv"):
        r = mem.chat("no-facts", "Say hello.", [], mode=mode, max_tokens=8)
        assert r.answer and r.fallbacks == 0
