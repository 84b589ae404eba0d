"""ExactIndex behaviour: scores, ties, replace, swap-delete, scopes, filters, bad input."""

from __future__ import annotations

import numpy as np
import pytest

from kvmem.errors import InvalidInputError
from kvmem.index import ExactIndex, Hit, VectorIndex


def unit(*xs: float) -> np.ndarray:
    v = np.asarray(xs, dtype=np.float32)
    return v / np.linalg.norm(v)


@pytest.fixture
def index() -> ExactIndex:
    ix = ExactIndex(3)
    ix.add("u", ["x", "y", "z"], np.eye(3), [{"kind": "a"}, {"kind": "b"}, {"kind": "a"}])
    return ix


def test_is_a_vector_index(index):
    assert isinstance(index, VectorIndex) and index.dim == 3


def test_scores_are_cosines_sorted_desc(index):
    hits = index.search("u", unit(3, 2, 1), k=3)
    assert [h.id for h in hits] == ["x", "y", "z"]
    np.testing.assert_allclose([h.score for h in hits], unit(3, 2, 1), rtol=1e-6)
    assert all(isinstance(h.score, float) for h in hits)


def test_inputs_are_normalised(index):
    # Unnormalised vectors and queries still give cosine scores.
    index.add("v", ["long"], np.array([[10.0, 0, 0]]))
    assert index.search("v", np.array([0.0, 0, 5.0]) + np.array([5.0, 0, 0]), 1)[0].score == pytest.approx(
        np.sqrt(0.5), rel=1e-6
    )


def test_ties_are_broken_by_id():
    ix = ExactIndex(2)
    ix.add("u", ["d", "b", "c", "a", "e"], np.tile(unit(1, 1), (5, 1)))
    ix.add("u", ["far"], unit(-1, 0)[None, :])
    assert [h.id for h in ix.search("u", unit(1, 1), 3)] == ["a", "b", "c"]
    assert [h.id for h in ix.search("u", unit(1, 1), 10)] == ["a", "b", "c", "d", "e", "far"]


def test_k_larger_than_scope(index):
    assert len(index.search("u", unit(1, 0, 0), 100)) == 3


def test_readd_replaces_in_place(index):
    index.add("u", ["x"], unit(0, 0, 1)[None, :], [{"kind": "b"}])
    assert index.count("u") == 3
    hits = index.search("u", unit(0, 0, 1), 2)
    assert [h.id for h in hits] == ["x", "z"]
    assert [h.id for h in index.search("u", unit(0, 0, 1), 3, {"kind": "b"})] == ["x", "y"]


def test_repeated_id_in_one_batch_keeps_the_last(index):
    index.add("w", ["p", "p"], np.array([[1.0, 0, 0], [0, 1.0, 0]]), [{"v": 1}, {"v": 2}])
    assert index.count("w") == 1
    assert index.search("w", unit(0, 1, 0), 1) == [Hit("p", pytest.approx(1.0))]
    assert index.search("w", unit(0, 1, 0), 1, {"v": 2})[0].id == "p"


def test_remove_swaps_last_row_in(index):
    assert index.remove("u", "x") is True
    assert index.remove("u", "x") is False
    assert index.remove("nope", "x") is False
    assert index.count("u") == 2 and len(index) == 2
    # z moved into x's row: it must still be found with its own vector and metadata.
    assert index.search("u", unit(0, 0, 1), 1)[0].id == "z"
    assert [h.id for h in index.search("u", unit(1, 1, 1), 5, {"kind": "a"})] == ["z"]
    assert "x" not in [h.id for h in index.search("u", unit(1, 0, 0), 5)]


def test_removing_everything_then_reusing_scope(index):
    for id_ in ("y", "z", "x"):
        assert index.remove("u", id_)
    assert index.count("u") == 0 and len(index) == 0
    assert index.search("u", unit(1, 0, 0), 3) == []
    index.add("u", ["x"], unit(1, 0, 0)[None, :])
    assert [h.id for h in index.search("u", unit(1, 0, 0), 3)] == ["x"]


def test_scopes_are_isolated(index):
    index.add("other", ["x", "q"], np.array([[0, 1.0, 0], [1.0, 0, 0]]))
    assert index.count("u") == 3 and index.count("other") == 2 and len(index) == 5
    assert index.search("other", unit(0, 1, 0), 1)[0].id == "x"
    assert index.search("u", unit(0, 1, 0), 1)[0].id == "y"
    assert "q" not in [h.id for h in index.search("u", unit(1, 0, 0), 10)]
    assert index.remove("other", "y") is False  # y lives in u only
    assert index.remove_scope("other") == 2
    assert index.remove_scope("other") == 0
    assert index.count("other") == 0 and index.count("u") == 3
    assert index.search("other", unit(1, 0, 0), 1) == []


def test_filter_first_then_top_k():
    ix = ExactIndex(2)
    angles = np.linspace(0, np.pi / 2, 20)
    ix.add("u", [f"f{i:02d}" for i in range(20)], np.stack([np.cos(angles), np.sin(angles)], axis=1),
           [{"even": i % 2 == 0, "i": i} for i in range(20)])
    # The query's 3 nearest are f00..f02; filtering must not leave fewer than k results.
    hits = ix.search("u", unit(1, 0), 3, {"even": False})
    assert [h.id for h in hits] == ["f01", "f03", "f05"]
    hits = ix.search("u", unit(1, 0), 4, {"i": {"gte": 15}, "even": True})
    assert [h.id for h in hits] == ["f16", "f18"]
    assert ix.search("u", unit(1, 0), 3, {"i": {"gt": 100}}) == []



def test_remembered_filter_results_follow_every_write():
    """A scope remembers which rows pass its recent filters; every add, re-add and swap-remove
    must make that stale. Oracle: a brute-force filter over what is live, after each write."""
    from kvmem.index.filters import matches

    rng = np.random.default_rng(0)
    ix, live = ExactIndex(4), {}
    filters = [{"tag": "a"}, {"n": {"gte": 5}}, {"tag": {"in": ["b", "c"]}, "n": {"lt": 7}}]
    q = unit(1, 0.5, 0.2, 0.1)
    for step in range(120):
        fact = f"f{rng.integers(30)}"
        if live and rng.random() < 0.3:
            victim = sorted(live)[rng.integers(len(live))]
            assert ix.remove("u", victim)
            del live[victim]
        else:
            meta, vec = {"tag": "abc"[rng.integers(3)], "n": int(rng.integers(10))}, rng.normal(size=4)
            ix.add("u", [fact], vec[None, :], [meta])
            live[fact] = (vec / np.linalg.norm(vec), meta)
        for f in filters:
            got = {h.id for h in ix.search("u", q, 50, f)}
            assert got == {i for i, (_, m) in live.items() if matches(m, f)}, (step, f)
    assert len(ix._scopes["u"].filters) == len(filters)  # remembered, and refreshed after writes

def test_metadata_is_copied():
    ix = ExactIndex(2)
    meta = {"user": "ana"}
    ix.add("u", ["a"], unit(1, 0)[None, :], [meta])
    meta["user"] = "bob"
    assert ix.search("u", unit(1, 0), 1, {"user": "ana"})[0].id == "a"


def test_growth_and_shrink_keep_rows():
    ix = ExactIndex(4)
    rng = np.random.default_rng(0)
    vecs = rng.normal(size=(300, 4)).astype(np.float32)
    ids = [f"v{i}" for i in range(300)]
    for i in range(0, 300, 7):  # many small appends force several doublings
        ix.add("u", ids[i : i + 7], vecs[i : i + 7])
    for id_ in ids[:290]:  # and removes force shrinking
        assert ix.remove("u", id_)
    assert ix.count("u") == 10
    for i in range(290, 300):
        assert ix.search("u", vecs[i], 1)[0].id == ids[i]


@pytest.mark.parametrize("k", [0, -1, 1.5, True, None, "3"])
def test_bad_k(index, k):
    with pytest.raises(InvalidInputError, match="k must be an int >= 1"):
        index.search("u", unit(1, 0, 0), k)


def test_k_accepts_numpy_ints(index):
    assert len(index.search("u", unit(1, 0, 0), np.int64(2))) == 2


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda ix: ix.search("u", np.ones(4), 1), r"query must have shape \[3\], got \[4\]"),
        (lambda ix: ix.search("u", np.ones((1, 3)), 1), r"query must have shape \[3\], got \[1, 3\]"),
        (lambda ix: ix.search("u", np.zeros(3), 1), "zero vector"),
        (lambda ix: ix.search("u", np.ones(3), 1, {"a": {"bad": 1}}), "unknown filter operator 'bad'"),
        (lambda ix: ix.search("nope", np.ones(3), 1, ["a"]), "filters must be a dict"),
        (lambda ix: ix.search(3, np.ones(3), 1), "scope_key must be a str"),
        (lambda ix: ix.add("u", ["a"], np.ones((1, 4))), r"vectors must have shape \[n, 3\], got \[1, 4\]"),
        (lambda ix: ix.add("u", ["a"], np.ones(3)), r"vectors must have shape \[n, 3\], got \[3\]"),
        (lambda ix: ix.add("u", ["a", "b"], np.ones((1, 3))), "got 1 vectors for 2 ids"),
        (lambda ix: ix.add("u", ["a"], np.array([[np.nan, 1, 1]])), "NaN or infinity"),
        (lambda ix: ix.add("u", ["a"], np.zeros((1, 3))), "zero vector"),
        (lambda ix: ix.add("u", "ab", np.ones((2, 3))), "ids must be a list of strings"),
        (lambda ix: ix.add("u", ["a", 2], np.ones((2, 3))), "ids must be non-empty strings, got 2"),
        (lambda ix: ix.add("u", ["a"], np.ones((1, 3)), [{}, {}]), r"one dict per id \(1\)"),
        (lambda ix: ix.add("u", ["a"], np.ones((1, 3)), ["meta"]), "each metadata must be a dict or None"),
        (lambda ix: ix.add(None, ["a"], np.ones((1, 3))), "scope_key must be a str"),
        (lambda ix: ix.remove("u", 5), "ids must be non-empty strings"),
    ],
)
def test_bad_input_is_refused_without_changes(index, call, message):
    with pytest.raises(InvalidInputError, match=message):
        call(index)
    assert index.count("u") == 3 and len(index) == 3


@pytest.mark.parametrize(
    "call, param",
    [
        (lambda ix: ix.search("u", np.ones(4), 1), "query"),
        (lambda ix: ix.search("u", np.zeros(3), 1), "query"),  # checked as rows, named as the query
        (lambda ix: ix.search("u", unit(1, 0, 0), 0), "k"),
        (lambda ix: ix.search("u", np.ones(3), 1, {"a": {"bad": 1}}), "filters"),
        (lambda ix: ix.search(3, np.ones(3), 1), "scope_key"),
        (lambda ix: ix.add("u", ["a"], np.zeros((1, 3))), "vectors"),
        (lambda ix: ix.add("u", ["a", 2], np.ones((2, 3))), "ids"),
        (lambda ix: ix.add("u", ["a"], np.ones((1, 3)), ["meta"]), "metadata"),
        (lambda ix: ExactIndex(0), "dim"),
    ],
)
def test_refusals_name_the_argument_at_fault(index, call, param):
    with pytest.raises(InvalidInputError) as err:
        call(index)
    assert (err.value.param, err.value.code) == (param, InvalidInputError.INVALID_VALUE)


def test_export_hands_out_copies_of_the_scope(index):
    """What TieredIndex moves to the graph: the scope as it is, and nothing the index still holds."""
    ids, vectors, metas = index.export("u")
    assert ids == ["x", "y", "z"] and np.allclose(vectors, np.eye(3)) and metas[0] == {"kind": "a"}
    vectors[:], metas[0]["kind"] = 0, "changed"
    assert index.search("u", unit(1, 0, 0), 1)[0].id == "x" and index.export("u")[2][0] == {"kind": "a"}
    ids, vectors, metas = index.export("nobody")
    assert ids == [] and vectors.shape == (0, 3) and metas == []


@pytest.mark.parametrize("dim", [0, -3, 2.0, True])
def test_bad_dim(dim):
    with pytest.raises(InvalidInputError, match="dim must be an int >= 1"):
        ExactIndex(dim)


def test_empty_add_is_a_no_op():
    ix = ExactIndex(3)
    ix.add("u", [], np.zeros((0, 3)))
    assert ix.count("u") == 0 and len(ix) == 0
