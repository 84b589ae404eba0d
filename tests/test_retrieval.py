"""Hybrid retrieval through the service: the lexical index stays in step with every write."""

from __future__ import annotations

import pytest

from kvmem.config import Config
from kvmem.errors import InvalidInputError
from kvmem.facts.text import search_text
from kvmem.index.lexical import LexicalIndex
from kvmem.service import KVMem

CARS = [f"Maya's neighbour {n} drives a {c} car to work every day." for n, c in
        [("Ines", "red"), ("Omar", "green"), ("Lia", "silver"), ("Jon", "black"), ("Eva", "white"), ("Kai", "grey")]]
BERTHA = "Maya drives an old blue Volvo that she calls Bertha."
QUERIES = ["Who is Bertha?", "Which car does the neighbour drive?", "What colour is the Volvo?", "pottery class"]


@pytest.fixture
def mem(tmp_path, model_dir):
    config = Config(home=tmp_path / "home", models_home=model_dir.parent)
    with KVMem(config, start_engine=False) as m:
        yield m


def rebuilt(mem) -> LexicalIndex:
    fresh = LexicalIndex()
    for fact_id, _, text, context, origin, _ in mem.facts.texts():
        fresh.add(mem.get(fact_id).scope.user_id, [fact_id], [search_text(text, context, origin)])
    return fresh


def assert_in_step(mem, user: str) -> None:
    fresh = rebuilt(mem)
    for q in QUERIES:
        assert mem.retrieval.lexical.search(user, q, 20) == fresh.search(user, q, 20), q


def test_a_fact_named_by_the_query_is_found(mem):
    ids = mem.add(facts=CARS + [BERTHA], user_id="u", encode="none").ids
    lexical = mem.search("Who is Bertha?", user_id="u", k=2, ranking="lexical")
    assert lexical[0].id == ids[-1]
    hybrid = mem.search("Who is Bertha?", user_id="u", k=2)
    assert ids[-1] in [h.id for h in hybrid] and all(0 <= h.score <= 1 for h in hybrid)
    dense = mem.search("Who is Bertha?", user_id="u", k=2, ranking="dense")
    assert [h.score for h in dense] == sorted((h.score for h in dense), reverse=True)
    with pytest.raises(InvalidInputError, match="ranking must be one of"):
        mem.search("x", user_id="u", ranking="bm25")


def test_lexical_index_follows_updates_deletes_and_filters(mem):
    ids = mem.add(facts=CARS + [BERTHA], user_id="u", metadata={"topic": "cars"}, encode="none").ids
    mem.add(facts=["Maya started a pottery class."], user_id="u", metadata={"topic": "hobby"}, encode="none",
            origin="Maya: I signed up for a class where we throw clay, my first bowl is drying")
    mem.add(facts=["Bertha is Tom's grandmother."], user_id="other", encode="none")
    assert_in_step(mem, "u")
    mem.update(ids[-1], "Maya drives an old blue Volvo that she calls Greta.")
    assert ids[-1] not in [h.id for h in mem.search("Bertha", user_id="u", k=5, ranking="lexical")]
    assert mem.search("Greta", user_id="u", k=1, ranking="lexical")[0].id == ids[-1]
    mem.delete(ids[0])
    assert ids[0] not in [h.id for h in mem.search("Ines red car", user_id="u", k=10)]
    assert [h.text for h in mem.search("pottery", user_id="u", k=5, filters={"topic": "hobby"})] == \
        ["Maya started a pottery class."]
    assert mem.search("pottery", user_id="u", k=5, filters={"topic": "cars"}, ranking="lexical") == []
    assert_in_step(mem, "u")
    assert [h.text for h in mem.search("Bertha", user_id="other", k=5, ranking="lexical")] == ["Bertha is Tom's grandmother."]
    mem.delete_all(user_id="u")
    assert mem.search("pottery", user_id="u", k=5) == [] and mem.retrieval.lexical.count("u") == 0
    mem.reset()
    assert mem.retrieval.lexical.count("other") == 0


PUPPY = [{"role": "user", "content": "My sister adopted a puppy called Bruno."},
         {"role": "assistant", "content": "How lovely! What is it like?"},
         {"role": "user", "content": "She walks him on the beach at sunrise."}]


def test_a_turn_is_found_by_the_turns_it_is_encoded_after(tmp_path, model_dir):
    """The third turn never names Bruno; its window does. Searched by its text alone, the first
    turn (which names him) came first for the query; the restarted service must agree."""
    config = Config(home=tmp_path / "home", models_home=model_dir.parent)
    with KVMem(config, start_engine=False) as mem:
        ids = mem.add(PUPPY, user_id="u", window=2, encode="none").ids
        for ranking in ("lexical", "hybrid"):
            top = mem.search("Where does Bruno walk?", user_id="u", k=1, ranking=ranking)[0]
            assert (top.id, top.text) == (ids[2], "user: She walks him on the beach at sunrise."), ranking
        assert_in_step(mem, "u")
        mem.update(ids[2], "She walks him in the park at sunrise.")
        assert mem.search("Where does Bruno walk?", user_id="u", k=1, ranking="lexical")[0].id == ids[2]
    with KVMem(config, start_engine=False) as mem:
        assert mem.search("Where does Bruno walk?", user_id="u", k=1, ranking="lexical")[0].id == ids[2]
        assert_in_step(mem, "u")
        plain = mem.add(PUPPY, user_id="v", window=0, encode="none").ids
        assert [h.id for h in mem.search("Bruno", user_id="v", k=5, ranking="lexical")] == [plain[0]]
        assert ids[2] in [h.id for h in mem.search("Bruno", user_id="u", k=5, ranking="lexical")]


MORTGAGE = [{"role": "user", "content": "The mortgage broker wants our last three tax returns and the payslips by Friday."},
            {"role": "assistant", "content": "Do you have the paperwork from the bank about the interest rate and the escrow account?"},
            {"role": "user", "content": "Also my daughter started violin lessons today."}]


def test_a_turn_is_still_found_by_its_own_words_after_an_unrelated_window(mem):
    """Embedded with its window alone, the violin turn lost to a fact about a piano (cosine 0.29
    against 0.40): two turns about mortgages drowned it. Its vector now keeps its own text's pull;
    its update keeps it too."""
    ids = mem.add(MORTGAGE, user_id="u", window=2, encode="none").ids
    mem.add(facts=["My neighbour plays the piano every evening.", "The bank approved the loan this morning."],
            user_id="u", encode="none")
    query = "What instrument is my daughter learning?"
    assert mem.search(query, user_id="u", k=1, ranking="dense")[0].id == ids[2]
    mem.update(ids[2], "Also my daughter started cello lessons today.")
    assert mem.search(query, user_id="u", k=1, ranking="dense")[0].id == ids[2]


@pytest.mark.parametrize("ranking", ["hybrid", "dense", "lexical"])
@pytest.mark.parametrize("k", [0, None, 2.5, True, "3"])
def test_a_bad_k_is_refused_by_every_ranking(mem, ranking, k):
    """Hybrid search once crashed on k=None with a TypeError (the dense index checked k itself)."""
    mem.add(facts=[BERTHA], user_id="u", encode="none")
    with pytest.raises(InvalidInputError, match="k must be an int >= 1"):
        mem.search("Bertha", user_id="u", k=k, ranking=ranking)


def test_reembed_brings_a_home_written_the_old_way_up_to_date(tmp_path, model_dir):
    """A home written before a turn's vector kept its own text (context only: the violin turn
    lost to the piano) ranks the old way after a restart; `reembed` rewrites its vectors, in
    the store too, and leaves other users' alone when asked for one."""
    import numpy as np

    from kvmem.embed.fact import fact_vectors

    config = Config(home=tmp_path / "home", models_home=model_dir.parent)
    query = "What instrument is my daughter learning?"
    with KVMem(config, start_engine=False) as mem:
        ids = mem.add(MORTGAGE, user_id="u", window=2, encode="none").ids
        mem.add(facts=["My neighbour plays the piano every evening.", "The bank approved the loan this morning."],
                user_id="u", encode="none")
        other = mem.add(MORTGAGE, user_id="w", window=2, encode="none").ids
        for fact_id in ids + other:  # as an older kvmem stored them: text + context alone
            r = mem.get(fact_id)
            mem.facts.set_embedding(fact_id, mem.embedder.embed([search_text(r.text, r.context)])[0])
    with KVMem(config, start_engine=False) as mem:
        assert mem.search(query, user_id="u", k=1, ranking="dense")[0].id != ids[2]  # the old ranking
        with pytest.raises(InvalidInputError, match="batch must be an int >= 1"):
            mem.reembed(batch=0)
        assert mem.reembed(user_id="u", batch=2) == 5
        assert mem.search(query, user_id="u", k=1, ranking="dense")[0].id == ids[2]
        stale = mem.get(other[2]).embedding
    with KVMem(config, start_engine=False) as mem:  # the new vectors were stored, not only indexed
        assert mem.search(query, user_id="u", k=1, ranking="dense")[0].id == ids[2]
        records = [mem.get(i) for i in ids]
        want = fact_vectors(mem.embedder, [r.text for r in records], [r.context for r in records])
        assert np.allclose(np.stack([r.embedding for r in records]), want, atol=1e-6)
        assert np.array_equal(mem.get(other[2]).embedding, stale)  # user w was not asked for


def test_a_fact_is_found_by_the_words_of_its_origin_and_encoded_without_it(mem):
    said = "Caroline: I went to an LGBTQ support group yesterday and it was so powerful."
    (plain,) = mem.add(facts=["Caroline went to a support group."], user_id="a", encode="none").ids
    (drawn,) = mem.add(facts=["Caroline went to a support group."], user_id="b", encode="none", origin=said).ids
    assert mem.search("LGBTQ", user_id="a", k=1, ranking="lexical") == []
    assert mem.search("LGBTQ", user_id="b", k=1, ranking="lexical")[0].id == drawn
    hits = mem.search("Who felt powerful at the LGBTQ meeting?", user_id="b", k=1, ranking="dense")
    assert hits[0].text == "Caroline went to a support group."  # hits show the fact, not its origin
    record = mem.get(drawn)
    assert record.context == mem.get(plain).context == "" and record.origin == said  # its KV: as without
    assert not (record.embedding == mem.get(plain).embedding).all()
    mem.update(drawn, "Caroline went to a support group again.")  # an update keeps the origin
    assert mem.search("LGBTQ", user_id="b", k=1, ranking="lexical")[0].id == drawn
    assert mem.reembed(user_id="b") == 1
    assert mem.search("LGBTQ", user_id="b", k=1, ranking="lexical")[0].id == drawn
    with pytest.raises(InvalidInputError, match="origin applies to facts"):
        mem.add([{"role": "user", "content": "hi"}], user_id="b", origin=said)
    with pytest.raises(InvalidInputError, match="origin must be a string"):
        mem.add(facts=["x"], user_id="b", origin=None)


def test_warm_up_loads_the_embedder_and_leaves_no_trace(tmp_path, model_dir):
    from kvmem.embed import MiniLMEmbedder
    from kvmem.index import heap

    config = Config(home=tmp_path / "home", models_home=model_dir.parent)
    with KVMem(config, start_engine=False, embedder=MiniLMEmbedder()) as m:
        ids = m.add(facts=[BERTHA], user_id="u", encode="none").ids
        assert m.embedder.loaded  # adding embeds; a fresh one is what warm_up must load
    with KVMem(config, start_engine=False, embedder=MiniLMEmbedder()) as m:
        assert not m.embedder.loaded
        m.warm_up()
        assert m.embedder.loaded and heap.scatter_add.signatures  # the lexical ranking's kernel is compiled
        assert [h.id for h in m.search("Bertha", user_id="u", k=5)] == list(ids)
        assert m.search("warm-up", user_id="warm-up", k=5) == [] and m.facts.count() == 1


def test_a_fact_deleted_behind_the_indexes_back_is_left_out_not_an_error(mem):
    """Another gateway's delete (an expiry sweep) reaches this process's indexes a moment after
    the row is gone: a search in between ranks a fact it can no longer read. It is left out, as an
    expired one is, and the next hit takes its place (the fault suite's chat got a 404)."""
    ids = mem.add(facts=CARS + [BERTHA], user_id="u", encode="none").ids
    top = mem.search("Who is Bertha?", user_id="u", k=3)
    mem.facts.delete(top[0].id)  # the store alone: SQLite tells no index of it, as a late feed would not yet
    hits = mem.search("Who is Bertha?", user_id="u", k=3)
    assert top[0].id not in [h.id for h in hits] and len(hits) == 3 and {h.id for h in hits} <= set(ids)
