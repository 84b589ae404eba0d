"""The memory API on the real engine: encoding, bad input, forgetting, scopes, concurrency."""

from __future__ import annotations

import subprocess

import pytest

from kvmem.errors import InvalidInputError, UnknownFactError
from tests.helpers import add_fact, in_threads, tokens


def test_encoding_many_facts_writes_one_verified_blob_each(mem):
    texts = [f"Fact number {i}: the user's locker code ends in {i:02d}." for i in range(40)]
    result = mem.add(facts=texts, user_id="batch")
    assert result.created == 40 and result.encode.encoded == 40 and result.encode.failed == ()
    for fact_id in result.ids:
        record, blob = mem.get(fact_id), mem.kv.get(fact_id)
        assert record.kv_status == "encoded" and blob.token_ids == tokens(mem, record)
        assert blob.key.shape == (mem.model.num_layers, len(blob.token_ids), mem.model.num_kv_heads, mem.model.head_size)
    print(f"\nencoded 40 facts in {result.encode.seconds:.2f} s ({40 / result.encode.seconds:.1f} facts/s)")


def test_duplicates_within_a_scope_are_stored_once(mem):
    first = mem.add(facts=["I like jazz."], user_id="dupes")
    again = mem.add(facts=["I like jazz.", "I like blues."], user_id="dupes")
    assert again.ids[0] == first.ids[0] and again.created == 1 and again.duplicates == 1


@pytest.mark.parametrize("facts,match", [
    ([""], "non-empty string"), (["   \n"], "non-empty string"), ([None], "non-empty string"), ([42], "non-empty string"),
    (["word " * 300], "limit is 256"), ([], "non-empty list"),
    (["\u0000"], "no visible characters"), (["\ufeff"], "no visible characters"), (["\u200b \u2060"], "no visible"),
    (["ok", "a\ud800"], "not valid Unicode"),
])
def test_bad_facts_are_refused(mem, facts, match):
    with pytest.raises(InvalidInputError, match=match):
        mem.add(facts=facts, user_id="bad-input")
    assert mem.get_all(user_id="bad-input") == []  # nothing half-stored


@pytest.mark.parametrize("messages,match", [
    ([{"role": "user", "content": 5}], "content must be a string"),
    ([{"role": "robot", "content": "hi"}], "role must be one of"),
    (["hello"], "must be a dict"),
    ([], "non-empty list"),
])
def test_bad_messages_are_refused(mem, messages, match):
    with pytest.raises(InvalidInputError, match=match):
        mem.add(messages, user_id="bad-input")


@pytest.mark.parametrize("user_id", ["", "  ", None, 7])
def test_missing_scope_is_refused(mem, user_id):
    with pytest.raises(InvalidInputError, match="user_id"):
        mem.add(facts=["A fact."], user_id=user_id)
    with pytest.raises(InvalidInputError, match="user_id"):
        mem.search("anything", user_id=user_id)


def test_unknown_ids_are_refused(mem):
    for call in (lambda: mem.get("f-nope"), lambda: mem.delete("f-nope"), lambda: mem.update("f-nope", "x"),
                 lambda: mem.history("f-nope"), lambda: mem.chat("Hi", user_id="u", fact_ids=["f-nope"])):
        with pytest.raises(UnknownFactError, match="f-nope"):
            call()


@pytest.mark.parametrize("filters,match", [({"n": {"between": [1, 2]}}, "operator"), ({"n": {"in": 3}}, "list"),
                                           ("color=red", "dict")])
def test_invalid_filters_are_refused(mem, filters, match):
    with pytest.raises(InvalidInputError, match=match):
        mem.search("anything", user_id="bad-input", filters=filters)


def test_bad_mode_and_foreign_facts_are_refused(mem):
    with pytest.raises(InvalidInputError, match="mode must be one of"):
        mem.chat("Hi", user_id="bad-input", mode="telepathy")
    secret = add_fact(mem, "owner", "The owner's secret is 42.")
    with pytest.raises(InvalidInputError, match="do not belong"):
        mem.chat("What is the secret?", user_id="intruder", fact_ids=[secret.id])


def test_prompt_that_cannot_fit_is_refused(mem):
    with pytest.raises(InvalidInputError, match="exceeds"):
        mem.chat("word " * 5000, user_id="bad-input", mode="text")


def test_chat_without_facts_answers_in_every_mode(mem):
    for mode in ("text", "kv", "off"):
        r = mem.chat("Say hello.", user_id="no-facts", mode=mode, max_tokens=8)
        assert r.answer and r.fallbacks == 0 and r.fact_ids == ()


def test_search_ranks_the_matching_fact_first_and_filters(mem):
    ids = mem.add(facts=["My car is a red Fiat.", "I was born in Oslo.", "My favourite dish is ramen."],
                  user_id="searcher").ids
    mem.update(ids[1], "I was born in Oslo in 1990.", metadata={"year": 1990})
    hits = mem.search("Where was I born?", user_id="searcher", k=3)
    assert hits[0].id == ids[1] and hits[0].score > hits[1].score
    assert [h.id for h in mem.search("Where was I born?", user_id="searcher", filters={"year": {"gte": 1991}})] == []
    assert [e.event for e in mem.history(ids[1])] == ["ADD", "UPDATE"]
    assert mem.kv.get(ids[1]).token_ids == tokens(mem, mem.get(ids[1]))  # re-encoded with the new text


def test_scopes_are_isolated_even_with_identical_text(mem):
    a = mem.add(facts=["My locker code is 4471."], user_id="scope-a").ids[0]
    b = mem.add(facts=["My locker code is 4471."], user_id="scope-b").ids[0]
    assert a != b
    assert [h.id for h in mem.search("locker code", user_id="scope-b", k=10)] == [b]
    r = mem.chat("What is my locker code?", user_id="scope-b", k=10, mode="kv", max_tokens=8)
    assert r.fact_ids == (b,)
    assert {f.id for f in mem.get_all(user_id="scope-a")} == {a}


def test_delete_forgets_text_vector_and_blob(mem):
    keep = add_fact(mem, "forget", "I have a cat named Pixel.")
    gone = add_fact(mem, "forget", "My bank PIN is zulu-wombat-quokka.")
    blob_path = mem.kv.path(gone.id)
    assert blob_path.exists() and mem.retrieval.dense.count("forget") == 2
    mem.delete(gone.id)
    assert not blob_path.exists() and mem.retrieval.dense.count("forget") == 1
    assert all(h.id != gone.id for h in mem.search("My bank PIN is zulu-wombat-quokka.", user_id="forget", k=10))
    r = mem.chat("My bank PIN is zulu-wombat-quokka.", user_id="forget", k=10, mode="kv", max_tokens=8)
    assert gone.id not in r.fact_ids and keep.id in r.fact_ids
    events = mem.history(gone.id)
    assert [e.event for e in events] == ["ADD", "DELETE"] and all(e.old_text is None and e.new_text is None for e in events)
    # Read by another process: closing a file this process opened drops all of its POSIX locks on
    # that file, SQLite's included, and a later connection that then finds itself alone deletes the
    # -wal and -shm files under the live one (the "disk I/O error" test_restart.py hit after this).
    for name in ("facts.sqlite", "facts.sqlite-wal"):
        path = mem.config.home / name
        content = subprocess.run(["cat", str(path)], capture_output=True, check=True).stdout if path.exists() else b""
        assert b"zulu-wombat-quokka" not in content, name


def test_delete_all_clears_one_scope(mem):
    mem.add(facts=["Run fact one.", "Run fact two."], user_id="scoped", run_id="r1")
    kept = mem.add(facts=["Other run fact."], user_id="scoped", run_id="r2").ids
    assert mem.delete_all(user_id="scoped", run_id="r1") == 2
    assert [f.id for f in mem.get_all(user_id="scoped")] == list(kept)
    assert [h.id for h in mem.search("fact", user_id="scoped", k=10)] == list(kept)


def test_ten_threads_adding_fifty_facts_each_lose_nothing(mem):
    in_threads(lambda t: mem.add(facts=[f"Thread {t} fact {i}: item {t * 100 + i} is stored." for i in range(50)],
                                 user_id="threads", encode="none"), 10)
    records = mem.get_all(user_id="threads", limit=1000)
    assert len(records) == 500 and mem.retrieval.dense.count("threads") == 500 and len({r.id for r in records}) == 500


def test_ten_threads_adding_and_encoding_at_once_get_every_blob(mem):
    in_threads(lambda t: mem.add(facts=[f"Thread {t} note {i}: box {t * 10 + i} is blue." for i in range(3)],
                                 user_id="threads-kv"), 10)
    records = mem.get_all(user_id="threads-kv", limit=1000)
    assert len(records) == 30 and mem.retrieval.dense.count("threads-kv") == 30
    assert sum(mem.kv.exists(r.id) for r in records) == 30
    assert all(r.kv_status == "encoded" for r in records)


def test_streaming_yields_the_same_answer_as_chat(mem):
    mem.add(facts=["My favourite colour is teal."], user_id="stream")
    q = "What is my favourite colour?"
    whole = mem.chat(q, user_id="stream", mode="kv", max_tokens=16)
    items = list(mem.chat_stream(q, user_id="stream", mode="kv", max_tokens=16))
    deltas, final = items[:-1], items[-1]
    assert all(isinstance(d, str) for d in deltas) and len(deltas) >= 2
    assert "".join(deltas).strip() == final.answer == whole.answer
    assert final.fact_ids == whole.fact_ids


def test_concurrent_chats_from_many_threads_all_answer(mem):
    mem.add(facts=[f"Guest {i} sits at table {i}." for i in range(8)], user_id="party")
    results = in_threads(lambda i: mem.chat(f"Where does guest {i % 8} sit?", user_id="party", k=3,
                                            mode="kv" if i % 2 else "text", max_tokens=8), 12)
    assert all(r.answer for r in results)
    # KV mode: memory came from blobs, or from this user's earlier KV-mode blocks in vLLM's cache.
    assert all(r.injected_tokens + r.cached_tokens > 0 and r.fallbacks == 0 for r in results[1::2])
    assert all(r.injected_tokens == 0 for r in results[::2])


ANSWER = ("A green Brompton folding bike that I bought second-hand in London in 2019 and ride to work "
          "every day along the canal, rain or shine, with a small red bag on the front.")  # > 1 block


def test_scoring_the_same_answer_twice_gives_the_same_logprobs(mem):
    # Regression: the second scoring request found the answer's tokens in vLLM's prefix cache,
    # where prompt logprobs are placeholders, and failed with a KeyError.
    ids = list(mem.add(facts=["My bike is a green Brompton."], user_id="scorer").ids)
    for mode in ("text", "kv"):
        first = mem.score("What bike do I ride?", ANSWER, user_id="scorer", fact_ids=ids, mode=mode)
        second = mem.score("What bike do I ride?", ANSWER, user_id="scorer", fact_ids=ids, mode=mode)
        assert len(first) == len(mem.prompts.context_tokens(ANSWER)) and all(lp <= 0 for lp in first)
        assert second == pytest.approx(first, abs=0.05)
    off = mem.score("What bike do I ride?", ANSWER, user_id="scorer", fact_ids=ids, mode="off")
    assert sum(off) < sum(first)  # the fact makes the gold answer more likely


def test_messages_with_free_text_timestamps_are_stored(mem):
    # Regression: a timestamp such as LoCoMo's "1:56 pm on 8 May, 2023" was passed on as an ISO
    # event_time and the whole add was refused.
    r = mem.add([{"role": "user", "content": "I joined a choir.", "timestamp": "1:56 pm on 8 May, 2023"},
                 {"role": "user", "content": "We sing on Tuesdays.", "timestamp": "2023-05-09T18:00:00"}],
                user_id="stamps", encode="none")
    first, second = (mem.get(i) for i in r.ids)
    assert first.text.startswith("[1:56 pm on 8 May, 2023]") and first.metadata["timestamp"] == "1:56 pm on 8 May, 2023"
    assert first.event_time is None and second.event_time.startswith("2023-05-09T18:00")


def test_facts_with_a_timestamp_show_their_date(mem):
    from datetime import datetime

    first = mem.get(mem.add(facts=["Maya sold her Volvo."], user_id="dated", timestamp="2023-05-09",
                            metadata={"topic": "cars"}, encode="none").ids[0])
    assert first.text == "[9 May 2023] Maya sold her Volvo."  # what search returns and the reader reads
    assert first.metadata == {"topic": "cars", "timestamp": "2023-05-09"} and first.event_time.startswith("2023-05-09")
    assert "9 May 2023" in mem.prompts.tokenizer.decode(mem.prompts.fact_tokens(first.text))
    second = mem.get(mem.add(facts=["Maya bought a bike."], user_id="dated", encode="none",
                             timestamp=datetime(2023, 6, 1, 9, 30)).ids[0])
    assert second.text == "[1 June 2023, 09:30] Maya bought a bike." and second.event_time.startswith("2023-06-01T09:30")
    free = mem.get(mem.add(facts=["Maya moved."], user_id="dated", timestamp="last summer", encode="none").ids[0])
    assert free.text == "[last summer] Maya moved." and free.event_time is None


@pytest.mark.parametrize("call, message", [
    (lambda m: m.add(facts=["x"], user_id="bad-stamp", timestamp=20230509), "timestamp must be"),
    (lambda m: m.add(facts=["x"], user_id="bad-stamp", timestamp="  "), "timestamp must be"),
    (lambda m: m.add([{"role": "user", "content": "hi"}], user_id="bad-stamp", timestamp="2023-05-09"),
     "timestamp applies to facts"),
    # Regression: a timestamped message with metadata that is not a dict raised TypeError.
    (lambda m: m.add([{"role": "user", "content": "hi", "timestamp": "2023-05-09"}], user_id="bad-stamp",
                     metadata=["topic"]), "metadata must be"),
])
def test_bad_timestamps_are_refused_before_anything_is_stored(mem, call, message):
    with pytest.raises(InvalidInputError, match=message):
        call(mem)
    assert mem.get_all(user_id="bad-stamp") == []


@pytest.mark.parametrize("call", [
    lambda m: m.add(facts=["x"], user_id="u\udfff"),
    lambda m: m.add(facts=["x"], user_id="bad-input", metadata={"k\ud800": 1}),
    lambda m: m.add(facts=["x"], user_id="bad-input", metadata={"k": {"deep": ["\ud800"]}}),
    lambda m: m.add([{"role": "user", "content": "hi \ud800"}], user_id="bad-input"),
    lambda m: m.add(facts=["x"], user_id="bad-input", context="\ud800"),
    lambda m: m.search("q \ud800", user_id="bad-input"),
    lambda m: m.chat("q \ud800", user_id="bad-input", mode="off"),
])
def test_lone_surrogates_are_refused_before_anything_is_stored(mem, call):
    with pytest.raises(InvalidInputError, match="not valid Unicode"):
        call(mem)
    assert mem.get_all(user_id="bad-input") == []


def test_a_conversation_too_long_to_fit_is_refused_without_tokenizing_it(mem, monkeypatch):
    huge = "x" * (mem.config.engine.max_model_len * mem.prompts.max_token_chars + 1)

    def no_tokenizing(text):
        raise AssertionError("tokenized a text that cannot fit")

    monkeypatch.setattr(mem.prompts, "_tokens", no_tokenizing)
    with pytest.raises(InvalidInputError, match="exceed the model"):
        mem.chat(huge, user_id="bad-input", mode="off")
    with pytest.raises(InvalidInputError, match="limit is 256"):
        mem.add(facts=["y" * (256 * mem.prompts.max_token_chars + 1)], user_id="bad-input")


def test_user_text_holding_the_old_prompt_marker_is_plain_text(mem):
    r = mem.chat("a \x00KVMEM-FACTS\x00 b", user_id="marker", mode="off", max_tokens=2)
    assert r.prompt_tokens > 0


def test_status_is_one_typed_snapshot_of_store_queue_tiers_and_engine(mem):
    from kvmem.engine.protocol import Engine, EngineStatus

    assert isinstance(mem.engine, Engine)  # the in-process engine implements the protocol
    mem.add(facts=["Status check: the kettle is blue."], user_id="status")
    status = mem.status()
    assert status.facts == mem.facts.count() and status.facts >= 1
    # Earlier tests leave facts stored with encode="none": the queue counts them, as the encoder does.
    assert status.encode_queue == mem.encoder.queue_depth() and status.kv_bytes == mem.kv.total_bytes() > 0
    assert status.tiers == mem.kv_tiers()
    assert isinstance(status.engine, EngineStatus) and status.engine.kind == "local" and status.engine.healthy
    assert status.engine.aborted == mem.engine.aborted
    mem.delete_all(user_id="status")


def test_chat_write_back_stores_the_last_user_turn_after_its_window(mem):
    user = "write-back"
    convo = [{"role": "user", "content": "I adopted a cat last week."},
             {"role": "assistant", "content": "Congratulations!"},
             {"role": "user", "content": "She is called Miso."}]
    r = mem.chat(convo, user_id=user, k=1, max_tokens=4, store="user")
    (fact_id,) = r.stored
    fact = mem.get(fact_id)
    assert fact.text == "user: She is called Miso." and fact.position == 2
    assert "I adopted a cat last week." in fact.context  # encoded after the turns before it (CWE)
    streamed = list(mem.chat_stream(convo, user_id=user, k=1, max_tokens=4, store="both"))
    assert streamed[-1].stored[0] == fact_id and len(streamed[-1].stored) == 2  # the turn again: deduplicated
    assert mem.chat("Hi", user_id=user, k=1, max_tokens=2).stored == ()
    with pytest.raises(InvalidInputError) as e:
        mem.chat("Hi", user_id=user, max_tokens=2, store="all")
    assert e.value.param == "store"
    mem.delete_all(user_id=user)


def test_relevant_text_facts_are_the_best_scored_moved_last(mem):
    """kv.text_facts_rule = "relevant": the fact retrieval scored best is the one prefilled as text,
    after the injected ones; "last" keeps stored order and prefills the latest."""
    from dataclasses import replace

    from kvmem.chat import ChatArgs

    ids = mem.add(facts=["I was born in Oslo.", "My car is a red Fiat.", "I collect old stamps."],
                  user_id="relevant-last").ids
    messages = [{"role": "user", "content": "Which car do I drive?"}]
    config = mem.chats.config
    try:
        for rule, last in (("last", ids[2]), ("relevant", ids[1])):
            mem.chats.config = replace(config, kv=replace(config.kv, text_facts_rule=rule))
            prepared = mem.chats.prepare(messages, ChatArgs(user_id="relevant-last", k=3, text_facts=1))
            assert [f.id for f in prepared.facts][-1] == last
            assert {f.id for f in prepared.facts} == set(ids)
            injected = {s.fact_id for s in prepared.request.plan.segments}
            assert last not in injected and len(injected & set(ids)) == 2
    finally:
        mem.chats.config = config
