"""GraphIndex (Vamana + RaBitQ) against exact search: recall floors, deletes, persistence, filters."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from kvmem.errors import IndexFileError, InvalidInputError
from kvmem.index import ExactIndex, VectorIndex
from kvmem.index import graph as graph_module
from kvmem.index.graph import GraphIndex, GraphIndexConfig
from kvmem.index.rabitq import RaBitQ, estimate, prepare_query
from kvmem.index.remembered import FILTERS_REMEMBERED
from kvmem.index.vamana import GraphParams

DIM = 128
N = 4000
K = 10
GRAPH_ONLY = GraphIndexConfig(exact_below=0)  # force the graph path even on small scopes


def clustered(n: int, seed: int, centres: int = 40) -> np.ndarray:
    """Unit vectors around `centres` random directions (the same for every seed), with offsets
    of varying size: clusters with dense cores, not flat blobs where every point is equidistant."""
    c = np.random.default_rng(0).standard_normal((centres, DIM))
    c /= np.linalg.norm(c, axis=1, keepdims=True)
    rng = np.random.default_rng(seed)
    g = rng.standard_normal((n, DIM))
    g /= np.linalg.norm(g, axis=1, keepdims=True)
    x = c[rng.integers(0, centres, n)] + rng.uniform(0.25, 1.75, (n, 1)) * g  # [n, DIM]
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


DATA = clustered(N, seed=1)
QUERIES = clustered(100, seed=2)
IDS = [f"f{i:05d}" for i in range(N)]
METAS = [{"b": i % 100, "tag": "even" if i % 2 == 0 else "odd"} for i in range(N)]


def build(config: GraphIndexConfig = GRAPH_ONLY) -> tuple[GraphIndex, ExactIndex]:
    g, e = GraphIndex(DIM, config), ExactIndex(DIM)
    for lo in range(0, N, 1000):  # several adds: the graph grows by batches, not one bulk build
        g.add("u", IDS[lo: lo + 1000], DATA[lo: lo + 1000], METAS[lo: lo + 1000])
        e.add("u", IDS[lo: lo + 1000], DATA[lo: lo + 1000], METAS[lo: lo + 1000])
    return g, e


@pytest.fixture(scope="module")
def built() -> tuple[GraphIndex, ExactIndex]:
    return build()


def recall(g: VectorIndex, e: VectorIndex, filters=None, queries: np.ndarray = QUERIES) -> float:
    found = [len({h.id for h in g.search("u", q, K, filters)} & {h.id for h in e.search("u", q, K, filters)})
             for q in queries]
    return sum(found) / (K * len(queries))


def test_is_a_vector_index(built):
    g, _ = built
    assert isinstance(g, VectorIndex) and g.count("u") == N and len(g) == N


def test_recall_floor_against_exact(built):
    g, e = built
    assert recall(g, e) >= 0.93


def test_wider_beam_reaches_near_exact(built):
    g, e = built
    graph = g.graph("u")
    hits = 0
    for q in QUERIES:
        slots, _ = graph.search(q, K, beam=128)
        hits += len({g._scopes["u"].ids[s] for s in slots.tolist()} & {h.id for h in e.search("u", q, K)})
    assert hits / (K * len(QUERIES)) >= 0.99


def test_default_beam_grows_with_the_graph():
    """Past beam_scale_from nodes the beam grows with sqrt(size): a fixed beam lost recall at 1M
    (0.75 at beam 32). Searches without a beam use it."""
    small = GraphIndex(DIM, GraphIndexConfig(graph=GraphParams(beam_scale_from=N), exact_below=0))
    scaled = GraphIndex(DIM, GraphIndexConfig(graph=GraphParams(search_beam=12, beam_scale_from=N // 4),
                                              exact_below=0))
    small.add("u", IDS, DATA)
    scaled.add("u", IDS, DATA)
    assert small.graph("u").default_beam() == 32
    graph = scaled.graph("u")
    assert graph.default_beam() == 24  # 12 * sqrt(4)
    for q in QUERIES[:20]:
        np.testing.assert_array_equal(graph.search(q, K)[0], graph.search(q, K, beam=24)[0])
    assert not all(np.array_equal(graph.search(q, K)[0], graph.search(q, K, beam=12)[0]) for q in QUERIES[:20])



FLOAT_ROWS = GraphIndexConfig(graph=GraphParams(vector_bits=32), exact_below=0)


@pytest.mark.parametrize("bits, atol", [(32, 1e-5), (8, 3e-3)])
def test_scores_are_cosines_best_first_to_the_rows_precision(bits, atol):
    g, _ = build(GraphIndexConfig(graph=GraphParams(vector_bits=bits), exact_below=0))
    by_id = dict(zip(IDS, DATA))
    worst = 0.0
    for q in QUERIES[:20]:
        hits = g.search("u", q, K)
        assert len(hits) == K
        scores = [h.score for h in hits]
        assert scores == sorted(scores, reverse=True)
        exact = [float(by_id[h.id] @ q) for h in hits]
        np.testing.assert_allclose(scores, exact, atol=atol)
        worst = max(worst, float(np.max(np.abs(np.subtract(scores, exact)))))
    assert bits == 32 or worst > 1e-5  # int8 rows really are rounded (the test would pass on float rows)


def test_int8_rows_cost_a_quarter_and_keep_recall():
    f32, e = build(FLOAT_ROWS)
    i8, _ = build()
    rows32, rows8 = f32.graph("u").vectors, i8.graph("u").vectors
    assert rows8.dtype == np.int8 and rows8.nbytes * 4 == rows32.nbytes
    # the whole index shrinks by the rows' three quarters (less a scale per row), whatever R and dim are
    assert f32.graph("u").nbytes() - i8.graph("u").nbytes() >= 0.7 * rows32.nbytes
    assert recall(i8, e) >= recall(f32, e) - 0.02


def test_rabitq_estimate_is_unbiased_and_informative():
    quant = RaBitQ.fit(DATA, seed=0)
    codes, factors = quant.encode(DATA)  # [N, W], [N]
    qbits = np.zeros((4, quant.words), np.uint64)
    errors, corr = [], []
    bits = np.unpackbits(codes.view(np.uint8), axis=1, bitorder="little")  # [N, Dp]
    for q in QUERIES[:20]:
        low, step, total = prepare_query(quant.signs, q, qbits)
        planes = np.unpackbits(qbits.view(np.uint8), axis=1, bitorder="little")  # [4, Dp]
        weighted = bits.astype(np.int64) @ (planes.T.astype(np.int64) @ (1 << np.arange(4)))  # [N]
        est = factors * (2 * (step * weighted + low * bits.sum(1)) - total) + quant.centroid @ q  # [N]
        exact = DATA @ q
        kernel = [estimate(codes[i], factors[i], qbits, low, step, total) for i in range(50)]
        np.testing.assert_allclose(np.asarray(kernel) + quant.centroid @ q, est[:50], atol=1e-4)
        errors.append(est - exact)
        corr.append(np.corrcoef(est, exact)[0, 1])
    errors = np.concatenate(errors)
    assert abs(errors.mean()) < 0.01  # unbiased: the mean error vanishes, the spread does not
    assert errors.std() < 0.15
    assert min(corr) > 0.7  # 1 bit per dimension at DIM=128: informative, far from exact


def test_deleted_ids_are_never_returned_and_consolidation_keeps_recall():
    g, e = build()
    rng = np.random.default_rng(3)
    top1 = {g.search("u", q, 1)[0].id for q in QUERIES}  # delete the best answers too
    gone = set(rng.choice(IDS, size=N // 5, replace=False).tolist()) | top1
    for id_ in sorted(gone):
        assert g.remove("u", id_) and e.remove("u", id_)
    graph = g.graph("u")
    assert len(graph.free) > 0, "deleting 20% must have run a consolidation"
    assert graph.tombstones < graph.params.consolidate_share * graph.size
    for q in QUERIES:
        assert not {h.id for h in g.search("u", q, 50)} & gone
    assert recall(g, e) >= 0.93
    assert g.count("u") == N - len(gone)


def test_consolidation_leaves_no_edge_to_a_freed_slot():
    g, _ = build()
    assert g.delete("u", IDS[: N // 4]) == N // 4
    graph = g.graph("u")
    freed = set(graph.free)
    assert freed
    for node in range(graph.size):
        if node not in freed and not graph.deleted[node]:
            assert not freed & set(graph.adj[node, : graph.deg[node]].tolist())


def test_freed_slots_are_reused_and_new_vectors_are_found():
    g, e = build()
    g.delete("u", IDS[:1000])
    e_ids = IDS[:1000]
    for id_ in e_ids:
        e.remove("u", id_)
    size_before = g.graph("u").size
    new = clustered(500, seed=9)
    new_ids = [f"new{i}" for i in range(500)]
    g.add("u", new_ids, new)
    e.add("u", new_ids, new)
    assert g.graph("u").size == size_before  # went into freed slots, no growth
    assert g.search("u", new[7], 1)[0].id == "new7"
    assert recall(g, e) >= 0.93


def test_readd_replaces_the_vector():
    g, _ = build()
    g.add("u", [IDS[0]], QUERIES[:1], [{"b": -1}])
    assert g.count("u") == N
    assert g.search("u", QUERIES[0], 1)[0].id == IDS[0]
    assert [h.id for h in g.search("u", QUERIES[0], 5, {"b": -1})] == [IDS[0]]


@pytest.fixture(scope="module")
def built_float() -> tuple[GraphIndex, ExactIndex]:
    return build(FLOAT_ROWS)


@pytest.mark.parametrize("rows", ["int8", "float32"])
@pytest.mark.parametrize("share", [0.01, 0.1, 0.5])
def test_filtered_search_matches_exact(built, built_float, rows, share):
    g, e = built if rows == "int8" else built_float
    filters = {"b": {"lt": int(share * 100)}}  # b is uniform over 0..99
    allowed = {id_ for id_, m in zip(IDS, METAS) if m["b"] < share * 100}
    for q in QUERIES[:30]:
        assert {h.id for h in g.search("u", q, K, filters)} <= allowed
    r = recall(g, e, filters, QUERIES[:30])
    if share >= g.config.filter_exact_share:
        assert r >= 0.9  # a widened walk
    else:  # a scan of the passing rows: exact on float32 rows, int8 rounding on int8 ones
        assert r == 1.0 if rows == "float32" else r >= 0.97


def test_small_scopes_are_exact():
    g, e = GraphIndex(DIM), ExactIndex(DIM)  # default config: below exact_below, a scan
    g.add("s", IDS[:300], DATA[:300], METAS[:300])
    e.add("s", IDS[:300], DATA[:300], METAS[:300])
    for q in QUERIES[:10]:
        assert [h.id for h in g.search("s", q, K)] == [h.id for h in e.search("s", q, K)]


def test_save_load_round_trip(built, tmp_path):
    g, _ = built
    path = tmp_path / "index.npz"
    g.save(path)
    h = GraphIndex.load(path)
    assert h.count("u") == N and h.config == g.config
    for q in QUERIES:
        assert h.search("u", q, K) == g.search("u", q, K)
        assert h.search("u", q, K, {"tag": "odd"}) == g.search("u", q, K, {"tag": "odd"})


def test_loaded_index_keeps_growing_like_the_original(tmp_path):
    g, _ = build()
    g.delete("u", IDS[:500])
    g.save(tmp_path / "a.npz")
    h = GraphIndex.load(tmp_path / "a.npz")
    more = clustered(300, seed=11)
    for ix in (g, h):
        ix.add("u", [f"m{i}" for i in range(300)], more)
    for q in QUERIES[:30]:
        assert h.search("u", q, K) == g.search("u", q, K)


def test_crash_during_save_leaves_previous_index_loadable(built, tmp_path, monkeypatch):
    g, _ = built
    path = tmp_path / "index.npz"
    g.save(path)
    before = [g.search("u", q, K) for q in QUERIES[:10]]

    other = GraphIndex(DIM, GRAPH_ONLY)
    other.add("v", IDS[:50], DATA[:50])

    def savez_then_crash(f, **arrays):
        f.write(b"PK\x03\x04 half a zip")  # the write is under way ...
        raise OSError("disk full")  # ... and dies midway

    monkeypatch.setattr(graph_module.np, "savez", savez_then_crash)
    with pytest.raises(OSError, match="disk full"):
        other.save(path)
    monkeypatch.undo()

    assert os.listdir(tmp_path) == ["index.npz"]  # the temp file is gone too
    loaded = GraphIndex.load(path)
    assert loaded.count("v") == 0
    assert [loaded.search("u", q, K) for q in QUERIES[:10]] == before


def test_format_1_file_loads_and_searches_like_the_index_it_saved(tmp_path):
    """Files written before int8 rows (float32 rows, no scales) still load, into the new layout."""
    g, _ = build(FLOAT_ROWS)
    g.save(tmp_path / "new.npz")
    with np.load(tmp_path / "new.npz") as z:
        arrays = {name: z[name] for name in z.files if not name.endswith("_scales")}
    header = json.loads(arrays["header"].tobytes())
    header["format"] = "kvmem-graph-index/1"
    del header["config"]["graph"]["vector_bits"]  # format 1 had no such knob
    arrays["header"] = np.frombuffer(json.dumps(header).encode(), np.uint8)
    np.savez(tmp_path / "old.npz", **arrays)
    old = GraphIndex.load(tmp_path / "old.npz")
    assert old.graph("u").vectors.dtype == np.int8  # re-stored with today's default rows
    same = sum(len({h.id for h in old.search("u", q, K)} & {h.id for h in g.search("u", q, K)}) for q in QUERIES)
    assert same / (K * len(QUERIES)) >= 0.97


def test_unreadable_file_raises_index_file_error(tmp_path):
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(IndexFileError):
        GraphIndex.load(bad)
    with pytest.raises(IndexFileError):
        GraphIndex.load(tmp_path / "missing.npz")


def test_delete_everything_drops_the_scope():
    g = GraphIndex(DIM, GRAPH_ONLY)
    g.add("u", IDS[:100], DATA[:100])
    assert g.delete("u", IDS[:100] + ["never"]) == 100
    assert g.count("u") == 0 and g.search("u", QUERIES[0], K) == []
    assert not g.remove("u", IDS[0])


def test_bad_input_is_refused():
    g = GraphIndex(DIM)
    with pytest.raises(InvalidInputError):
        g.add("u", ["a"], np.zeros((1, DIM)))
    with pytest.raises(InvalidInputError):
        g.add("u", ["a"], np.ones((1, DIM + 1)))
    with pytest.raises(InvalidInputError):
        g.search("u", np.ones(DIM), 0)
    with pytest.raises(InvalidInputError):
        GraphParams(degree=32, build_beam=16)
    assert len(g) == 0


def test_remembered_filter_results_follow_every_write():
    """A scope remembers which slots pass a filter; adds, replaces and deletes must not see stale ones."""
    g = GraphIndex(DIM, GraphIndexConfig(exact_below=0))
    g.add("u", IDS[:3000], DATA[:3000], METAS[:3000])
    odd = {"tag": "odd"}
    q = QUERIES[0]
    before = g.search("u", q, K, odd)
    assert g.search("u", q, K, odd) == before  # remembered: same answer
    g.add("u", ["new"], q[None, :], [{"tag": "odd", "b": 0}])  # the best possible match
    assert g.search("u", q, K, odd)[0].id == "new"
    g.add("u", ["new"], q[None, :], [{"tag": "even", "b": 0}])  # re-added: no longer passes
    assert "new" not in {h.id for h in g.search("u", q, K, odd)}
    assert g.search("u", q, K, {"tag": "even"})[0].id == "new"
    g.delete("u", ["new", before[0].id])
    hits = {h.id for h in g.search("u", q, K, odd)}
    assert "new" not in hits and before[0].id not in hits
    rare = {"b": {"lt": 1}}  # 1%: the scan path, remembered the same way
    first = g.search("u", q, K, rare)[0].id
    g.delete("u", [first])
    assert first not in {h.id for h in g.search("u", q, K, rare)}
    scope = g._scopes["u"]
    for i in range(12):  # more filters than a scope remembers: the oldest are dropped
        g.search("u", q, K, {"b": {"lt": i + 20}})
    assert len(scope.filters) == FILTERS_REMEMBERED
