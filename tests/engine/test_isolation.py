"""Users never share prefix-cache blocks, even with identical facts and identical prompts."""

from __future__ import annotations

from tests.helpers import add_fact

FACT = "My passport number is X1234567 and it expires in 2031."


def test_identical_prompts_of_two_users_share_no_blocks(mem):
    a = add_fact(mem, "iso-alice", FACT)
    b = add_fact(mem, "iso-bob", FACT)
    assert a.id != b.id  # identical text, two users: two facts, two blobs
    q = "When does my passport expire?"
    first_a = mem.chat(q, user_id="iso-alice", fact_ids=[a.id], mode="kv", max_tokens=8)
    assert first_a.cached_tokens == 0 and first_a.injected_tokens > 0

    bob = mem.chat(q, user_id="iso-bob", fact_ids=[b.id], mode="kv", max_tokens=8)
    assert bob.prompt_tokens == first_a.prompt_tokens
    assert bob.cached_tokens == 0  # alice's cached blocks were not offered to bob
    assert bob.injected_tokens == first_a.injected_tokens  # bob's own blobs were injected instead

    again_a = mem.chat(q, user_id="iso-alice", fact_ids=[a.id], mode="kv", max_tokens=8)
    assert again_a.cached_tokens > 0  # control: the same user does hit her own cached blocks
    assert again_a.answer == first_a.answer


def test_text_mode_never_reads_kv_mode_blocks(mem):
    f = add_fact(mem, "iso-modes", FACT)
    q = "What is my passport number?"
    kv = mem.chat(q, user_id="iso-modes", fact_ids=[f.id], mode="kv", max_tokens=8)
    assert kv.injected_tokens > 0
    # With the same salt, text mode would have reused the injected (approximate) blocks.
    text = mem.chat(q, user_id="iso-modes", fact_ids=[f.id], mode="text", max_tokens=8)
    assert text.injected_tokens == 0 and text.cached_tokens == 0
