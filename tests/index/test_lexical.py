"""LexicalIndex: BM25 by hand on a tiny corpus, and in-place updates against a rebuild."""

import math
import random

import pytest

from kvmem.index.lexical import LexicalIndex, terms

DOCS = {
    "a": "Caroline went to the LGBTQ support group on Sunday.",
    "b": "Melanie painted a sunrise over the lake.",
    "c": "Caroline's books: she reads two books a month.",
    "d": "Melanie and Caroline ran a charity race.",
}


def build(docs: dict[str, str], scope: str = "u") -> LexicalIndex:
    index = LexicalIndex()
    index.add(scope, list(docs), list(docs.values()))
    return index


def test_terms_are_stemmed_words_without_stopwords():
    assert terms("Caroline's Books, and the BOOK!") == ["carolin", "book", "book"]
    assert terms("She painted; painting paints. I a x 7") == ["paint", "paint", "paint"]  # 1-char words out
    assert terms("[8 May, 2023] went") == ["may", "2023", "went"]


def test_bm25_by_hand():
    index = build(DOCS)
    lengths = {i: len(terms(t)) for i, t in DOCS.items()}
    avg = sum(lengths.values()) / 4

    def bm25(term_freq: int, doc: str, df: int) -> float:  # Lucene's, k1=1.5, b=0.75
        idf = math.log(1 + (4 - df + 0.5) / (df + 0.5))
        return idf * term_freq * 2.5 / (term_freq + 1.5 * (0.25 + 0.75 * lengths[doc] / avg))

    hits = {h.id: h.score for h in index.search("u", "Caroline's books", k=10)}
    assert set(hits) == {"a", "c", "d"}  # b shares no term
    assert hits["c"] == pytest.approx(bm25(1, "c", 3) + bm25(2, "c", 1))
    assert hits["a"] == pytest.approx(bm25(1, "a", 3))
    assert [h.id for h in index.search("u", "Caroline's books", k=1)] == ["c"]
    assert index.search("u", "the of and", k=5) == []  # only stopwords
    assert index.search("nobody", "Caroline", k=5) == []


def test_filters_apply_to_lexical_hits():
    index = LexicalIndex()
    index.add("u", ["a", "b"], ["Caroline paints", "Caroline runs"], [{"kind": "art"}, {"kind": "sport"}])
    assert [h.id for h in index.search("u", "Caroline", 5, {"kind": "sport"})] == ["b"]


def test_in_place_updates_equal_a_rebuild():
    """Random adds, replacements and deletes across two scopes: every search equals the one of
    an index built from scratch over what is left."""
    rng = random.Random(0)
    words = "caroline melanie paint race book lake sunrise group support charity month sunday".split()
    index, live = LexicalIndex(), {"u1": {}, "u2": {}}
    for step in range(400):
        scope = rng.choice(list(live))
        fact_id = f"f{rng.randrange(60)}"
        if rng.random() < 0.3 and live[scope]:
            victim = rng.choice(sorted(live[scope]))
            assert index.remove(scope, victim)
            del live[scope][victim]
        else:
            text = " ".join(rng.choices(words, k=rng.randint(1, 8)))
            index.add(scope, [fact_id], [text])
            live[scope][fact_id] = text
        if step % 5 == 4:  # often: BM25 shares are remembered between writes
            for s, docs in live.items():
                fresh = build(docs, s) if docs else LexicalIndex()
                assert index.count(s) == len(docs)
                for q in ("caroline race", "book month", "lake sunrise group"):
                    got = [(h.id, round(h.score, 9)) for h in index.search(s, q, 20)]
                    assert got == [(h.id, round(h.score, 9)) for h in fresh.search(s, q, 20)]
    assert index.remove_scope("u1") == len(live["u1"]) and index.count("u1") == 0
    assert not index.remove("u1", "f1")


def test_top_keeps_exactly_top_with_ties_to_the_smaller_ids():
    """Equal scores at the cut do not all ride along (a query of common words tied thousands of
    facts and carried them all into the fusion); the smaller ids win, as `search` orders them."""
    index = LexicalIndex()
    ids = [f"f{i:02d}" for i in range(30)]
    index.add("u", ids[::-1], ["lake sunrise"] * 30)  # added in reverse: row order is not id order
    index.add("u", ["best"], ["lake lake sunrise"])
    scores = index.scores("u", "lake", top=5)
    assert len(scores) == 5
    assert sorted(scores) == ["best", "f00", "f01", "f02", "f03"]
    assert set(index.scores("u", "lake", top=5, also=["f29"])) == set(scores) | {"f29"}
    assert [h.id for h in index.search("u", "lake", 3)] == ["best", "f00", "f01"]
