"""`kvmem bench ann`: the graph index beside faiss HNSW, faiss IVF-RaBitQ + refine, hnswlib and
an exact scan, on one data set, in one run.

Data: clustered synthetic unit vectors (any size), or real MiniLM embeddings of LoCoMo's turns
(base) and questions (queries), read from the file by path. Per index: build time (2 threads),
bytes per vector (the index's own structures, serialised size for the libraries, array bytes
for ours; not RSS), recall@10 against exact search and QPS with 1 thread (one query per call,
best of 3 passes) over a sweep of its search parameter; then, at the parameter that first
reaches recall 0.95, QPS with 1 and 2 threads timed in interleaved rounds across all indexes
(the table's columns: medians); batched and one-at-a-time insert throughput, and recall after
deleting 10% (plus consolidation for ours).
faiss-cpu and hnswlib are optional (`pip install -e '.[bench]'`); a missing one is reported
and skipped, the rest still run.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

# How each index is measured lives in ann_measure; its names stay importable from here, where
# `kvmem bench ann`, the tests and scripts/ann_params.py have always found them.
from kvmem.bench.ann_measure import (  # noqa: F401 - re-exported
    PASSES, TARGET_RECALL, AnnConfig, AnnResult, Timed, delete_ids, exact_top, interleave, param_at,
    qps_threads, recall_at, sweep, temp_size, timed_build, truth_after_delete,
)
from kvmem.errors import InvalidInputError

INSTALL_HINT = "pip install -e '.[bench]'   (faiss-cpu==1.15.1, hnswlib==0.8.0)"


def clustered(cfg: AnnConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Base [n, dim], extra [extra, dim] and queries [q, dim], unit float32.

    Points sit around `centres` random unit directions; each offset is a random direction
    scaled by U(0.25, 1.75): dense cores and looser edges, like real embedding clusters.
    (Equal-size Gaussian blobs make every point of a cluster equidistant from every other,
    which no real embedding set does.)
    """
    rng = np.random.default_rng(cfg.seed)
    c = rng.standard_normal((cfg.centres, cfg.dim)).astype(np.float32)
    c /= np.linalg.norm(c, axis=1, keepdims=True)
    total = cfg.n + cfg.extra + cfg.queries
    g = rng.standard_normal((total, cfg.dim)).astype(np.float32)
    g /= np.linalg.norm(g, axis=1, keepdims=True)
    x = c[rng.integers(0, cfg.centres, total)] + rng.uniform(0.25, 1.75, (total, 1)).astype(np.float32) * g
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x[: cfg.n], x[cfg.n: cfg.n + cfg.extra], x[cfg.n + cfg.extra:]


def load_data(cfg: AnnConfig, log=print) -> tuple[AnnConfig, np.ndarray, np.ndarray, np.ndarray]:
    """(cfg with the data's sizes, base, extra, queries) for cfg.data."""
    if cfg.data == "clustered":
        base, extra, queries = clustered(cfg)
    elif cfg.data == "locomo":
        base, extra, queries = locomo_embeddings(cfg, log)
    else:
        raise InvalidInputError(f"unknown data set {cfg.data!r}: clustered or locomo", param="data")
    return replace(cfg, n=len(base), extra=len(extra), queries=len(queries), dim=base.shape[1]), base, extra, queries


def locomo_embeddings(cfg: AnnConfig, log=print) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """MiniLM embeddings: every turn of every conversation (a seeded 10% of them held out as the
    one-by-one inserts) and every question as a query."""
    from kvmem.bench import locomo
    from kvmem.embed.minilm import default_embedder

    convs = locomo.load(cfg.locomo or locomo.DEFAULT_PATH)
    turns = [locomo.turn_text(t) for c in convs for _, ts, _ in locomo.sessions(c) for t in ts]
    asked = [str(q["question"]) for c in convs for q in c["qa"] if q.get("question")]
    log(f"embedding {len(turns)} LoCoMo turns and {len(asked)} questions with MiniLM")
    embedder = default_embedder()
    vecs = np.ascontiguousarray(embedder.embed(turns), np.float32)  # [t, 384]
    queries = np.ascontiguousarray(embedder.embed(asked), np.float32)  # [q, 384]
    order = np.random.default_rng(cfg.seed).permutation(len(vecs))
    held = len(vecs) // 10
    return vecs[order[held:]], vecs[order[:held]], queries


def run(cfg: AnnConfig = AnnConfig(), log=print) -> dict:
    cfg, base, extra, queries = load_data(cfg, log)
    truth = exact_top(base, queries, 10)
    results, missing, paused = [], [], []
    for name in cfg.indexes:  # each runner builds and sweeps, then pauses at its `yield`
        runner = RUNNERS[name](cfg, base, extra, queries, truth, log)
        try:
            paused.append((runner, next(runner)))
        except ImportError as e:
            missing.append(f"{name}: {e} -> {INSTALL_HINT}")
            log(f"skipped {name}: {e}; install with {INSTALL_HINT}")
            continue
        log(f"{name}: built and swept")
    interleave([t for _, t in paused], cfg.rounds, log)
    filtered = run_filtered(cfg, base, queries, log) if "kvmem-graph" in cfg.indexes and cfg.filtered else []
    for runner, _ in paused:  # then inserts and deletes, one index at a time
        try:
            next(runner)
        except StopIteration as done:
            results.append(done.value)
            log(summary_row(done.value))
    return {"config": asdict(cfg), "machine": machine(), "results": [asdict(r) for r in results],
            "filtered": filtered, "missing": missing}


def run_filtered(cfg: AnnConfig, base: np.ndarray, queries: np.ndarray, log=print) -> list[dict]:
    """`GraphIndex` searches under a metadata filter passing 1%, 10% and 50% of the scope.

    Under `filter_exact_share` (20%) the index scans the passing rows; above it, it walks the
    graph with the beam widened by 1/share. Recall is against an exact scan of the passing rows.
    The first search with each filter is timed apart: it tests every row (the scope then
    remembers the passing rows until its next write).
    """
    from kvmem.index.graph import GraphIndex

    ix = GraphIndex(cfg.dim)
    bucket = np.arange(len(base)) % 100  # [n] uniform 0..99
    ix.add("s", [str(i) for i in range(len(base))], base, [{"b": int(b)} for b in bucket])
    rows = []
    for share in (0.01, 0.1, 0.5):
        passing = np.flatnonzero(bucket < share * 100)  # [m]
        truth = passing[exact_top(base[passing], queries, 10)]  # [q, 10] original ids
        flt = {"b": {"lt": int(share * 100)}}
        t = time.perf_counter()
        ix.search("s", queries[0], 10, flt)  # the first search with a filter tests every row's metadata
        first_ms = (time.perf_counter() - t) * 1e3
        best, found = float("inf"), None
        for _ in range(PASSES):
            t = time.perf_counter()
            found = np.stack([_pad(np.asarray([int(h.id) for h in ix.search("s", q, 10, flt)], np.int64))
                              for q in queries])
            best = min(best, time.perf_counter() - t)
        small = share < ix.config.filter_exact_share or len(passing) < ix.config.exact_below
        path = "scan" if small else "walk"
        rows.append({"share": share, "path": path, "recall": recall_at(found, truth), "qps1": len(queries) / best,
                     "first_ms": first_ms})
        log(f"filtered {share:.0%} ({path}): recall {rows[-1]['recall']:.3f}, {rows[-1]['qps1']:.0f} q/s, "
            f"first search {first_ms:.0f} ms")
    return rows


def machine() -> dict:
    cpu = ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "load_avg_at_end": os.getloadavg()[0]}


def summary_row(r: AnnResult) -> str:
    at = r.qps_at(TARGET_RECALL)
    qps = f"{r.qps1:.0f} ({at[1]})" if at else "-"
    best = max((s["recall"] for s in r.sweep), default=float("nan"))
    after = "-" if r.recall_after_delete is None else f"{r.recall_after_delete:.3f}"
    return (f"| {r.name} {r.params} | {r.build_s:.1f} | {r.bytes_per_vector:.0f} | {qps} | {r.qps2:.0f} | {best:.3f} "
            f"| {r.insert_batch_vps:.0f} | {r.insert_one_vps:.0f} | {after} {r.delete_note} |")


TABLE_HEAD = ("| index | build s (2 thr) | bytes/vec | QPS1 @ recall 0.95 (param) | QPS2 (same param) "
              "| max recall | insert batch v/s | insert 1-by-1 v/s | recall after 10% deletes |\n"
              "|---|---|---|---|---|---|---|---|---|")


def report(result: dict, out: Path) -> str:
    """Write <name>.json and <name>.png under `out`; return the markdown table."""
    out.mkdir(parents=True, exist_ok=True)
    name = result["config"].get("name", "ann")
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    rows = [AnnResult(**r) for r in result["results"]]
    table = "\n".join([TABLE_HEAD] + [summary_row(r) for r in rows])
    note = _plot(rows, out / f"{name}.png")
    if result.get("filtered"):
        table += ("\n\nGraphIndex under a metadata filter (kvmem-graph defaults; QPS1 once the scope remembers the "
                  "filter's passing rows, first search: testing every row):\n\n"
                  "| passing | path | recall@10 | QPS1 | first search ms |\n|---|---|---|---|---|\n")
        table += "\n".join(f"| {f['share']:.0%} | {f['path']} | {f['recall']:.3f} | {f['qps1']:.0f} "
                           f"| {f['first_ms']:.0f} |" for f in result["filtered"])
    return table + ("\n\n" + note if note else "") + "".join(f"\n\nmissing: {m}" for m in result["missing"])


def _plot(rows: list[AnnResult], path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "(matplotlib not installed: no plot)"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        ax.plot([s["recall"] for s in r.sweep], [s["qps1"] for s in r.sweep], marker="o", label=r.name)
    ax.set_xlabel("recall@10")
    ax.set_ylabel("queries/s, 1 thread")
    ax.set_yscale("log")
    ax.axvline(TARGET_RECALL, color="grey", lw=0.8, ls="--")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return ""


# -- the indexes ------------------------------------------------------------------------------
# Each runner is a generator: build (head + timed tail batch) and sweep, then yield a `Timed`
# (run() times every index in turn there), then one-by-one inserts of `extra`, then delete 10%
# of the base and measure recall at the parameter that first reached 0.95; it returns its result.


def _pad(ids: np.ndarray, k: int = 10) -> np.ndarray:
    out = np.full(k, -1, np.int64)
    out[: len(ids)] = ids[:k]
    return out


def run_graph(cfg, base, extra, queries, truth, log) -> AnnResult:
    from kvmem.index.vamana import GraphParams, VamanaGraph

    params = GraphParams(threads=cfg.threads)
    warm = VamanaGraph(cfg.dim, params)  # loads the cached numba kernels outside the timings
    warm.add(base[:500])
    warm.search(queries[0], 10)
    rows = "int8" if params.vector_bits == 8 else "float32"
    res = AnnResult("kvmem-graph", f"(R{params.degree},L{params.build_beam},a{params.alpha},1-bit RaBitQ,{rows} rows)")
    g = VamanaGraph(cfg.dim, params)
    head = int(cfg.n * (1 - cfg.batch_tail))
    t0 = time.perf_counter()
    g.add(base[:head])
    t1 = time.perf_counter()
    g.add(base[head:])
    t2 = time.perf_counter()
    res.build_s, res.insert_batch_vps = t2 - t0, (cfg.n - head) / (t2 - t1)
    res.bytes_per_vector = sum(a.nbytes for a in g.state().values()) / cfg.n
    beam = [10]
    search = lambda q: _pad(g.search(q, 10, beam[0])[0])  # noqa: E731
    res.sweep = sweep(search, lambda p: beam.__setitem__(0, p),
                      (10, 12, 16, 20, 24, 28, 32, 36, 40, 48, 64, 96, 128, 192, 256), queries, truth)
    yield Timed(res, search, lambda p: beam.__setitem__(0, p), queries)
    t = time.perf_counter()
    for v in extra:
        g.add(v[None, :])
    res.insert_one_vps = len(extra) / (time.perf_counter() - t)
    gone = delete_ids(cfg)
    t = time.perf_counter()
    g.delete(gone)
    g.consolidate()
    res.delete_note = f"(delete + consolidate {time.perf_counter() - t:.1f}s)"
    after = truth_after_delete(cfg, base, extra, queries, gone)
    p = param_at(res)
    found = np.stack([_pad(g.search(q, 10, p)[0]) for q in queries])
    res.recall_after_delete = recall_at(found, after)
    return res


def run_faiss_hnsw(cfg, base, extra, queries, truth, log) -> AnnResult:
    import faiss

    res = AnnResult("faiss-IndexHNSWFlat", "(M32,efC128)")
    faiss.omp_set_num_threads(cfg.threads)
    ix = faiss.IndexHNSWFlat(cfg.dim, 32, faiss.METRIC_INNER_PRODUCT)
    ix.hnsw.efConstruction = 128
    timed_build(res, cfg, lambda x: ix.add(x), base)
    res.bytes_per_vector = len(faiss.serialize_index(ix)) / cfg.n
    faiss.omp_set_num_threads(1)
    search, set_ef = lambda q: ix.search(q[None, :], 10)[1][0], lambda p: setattr(ix.hnsw, "efSearch", p)  # noqa: E731
    res.sweep = sweep(search, set_ef, (10, 12, 16, 20, 24, 32, 48, 64, 96, 128, 256), queries, truth)
    yield Timed(res, search, set_ef, queries)
    faiss.omp_set_num_threads(cfg.threads)
    t = time.perf_counter()
    for v in extra:
        ix.add(v[None, :])
    res.insert_one_vps = len(extra) / (time.perf_counter() - t)
    res.delete_note = "(IndexHNSWFlat has no delete)"
    return res


def run_faiss_ivf_rabitq(cfg, base, extra, queries, truth, log) -> AnnResult:
    import faiss

    res = AnnResult("faiss-IndexIVFRaBitQ+RefineFlat", "(nlist512,1bit,k_factor10)")
    faiss.omp_set_num_threads(cfg.threads)
    coarse = faiss.IndexFlatIP(cfg.dim)
    ivf = faiss.IndexIVFRaBitQ(coarse, cfg.dim, 512, faiss.METRIC_INNER_PRODUCT)
    ix = faiss.IndexRefineFlat(ivf)
    ix.k_factor = 10
    t = time.perf_counter()
    ix.train(base)
    train_s = time.perf_counter() - t
    timed_build(res, cfg, lambda x: ix.add(x), base)
    res.build_s += train_s
    res.bytes_per_vector = len(faiss.serialize_index(ix)) / cfg.n
    faiss.omp_set_num_threads(1)
    search, set_nprobe = lambda q: ix.search(q[None, :], 10)[1][0], lambda p: setattr(ivf, "nprobe", p)  # noqa: E731
    res.sweep = sweep(search, set_nprobe, (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128), queries, truth)
    yield Timed(res, search, set_nprobe, queries)
    faiss.omp_set_num_threads(cfg.threads)
    t = time.perf_counter()
    for v in extra:
        ix.add(v[None, :])
    res.insert_one_vps = len(extra) / (time.perf_counter() - t)
    gone = delete_ids(cfg)
    try:
        t = time.perf_counter()
        ix.remove_ids(gone.astype(np.int64))
        res.delete_note = f"(remove_ids {time.perf_counter() - t:.1f}s)"
    except RuntimeError:  # faiss raises RuntimeError for unsupported operations
        res.delete_note = "(IndexRefineFlat has no remove_ids)"
        return res
    # remove_ids renumbers the remaining vectors: map them back to original ids
    keep = np.setdiff1d(np.arange(cfg.n + cfg.extra), gone)
    after = truth_after_delete(cfg, base, extra, queries, gone)
    faiss.omp_set_num_threads(1)
    ivf.nprobe = param_at(res)
    found = np.stack([np.where((r := ix.search(q[None, :], 10)[1][0]) >= 0, keep[r], -1) for q in queries])
    res.recall_after_delete = recall_at(found, after)
    return res


def run_hnswlib(cfg, base, extra, queries, truth, log) -> AnnResult:
    import hnswlib

    res = AnnResult("hnswlib", "(M32,efC128)")
    ix = hnswlib.Index("ip", cfg.dim)
    ix.init_index(cfg.n + cfg.extra, M=32, ef_construction=128)
    ix.set_num_threads(cfg.threads)
    offset = [0]

    def add(x):
        ix.add_items(x, np.arange(offset[0], offset[0] + len(x)))
        offset[0] += len(x)

    timed_build(res, cfg, add, base)
    res.bytes_per_vector = temp_size(ix.save_index) / cfg.n
    ix.set_num_threads(1)
    search = lambda q: ix.knn_query(q[None, :], 10)[0][0]  # noqa: E731
    res.sweep = sweep(search, ix.set_ef, (10, 12, 16, 20, 24, 32, 48, 64, 96, 128, 256), queries, truth)
    yield Timed(res, search, ix.set_ef, queries)
    t = time.perf_counter()
    for v in extra:
        add(v[None, :])
    res.insert_one_vps = len(extra) / (time.perf_counter() - t)
    gone = delete_ids(cfg)
    t = time.perf_counter()
    for i in gone.tolist():
        ix.mark_deleted(i)
    res.delete_note = f"(mark_deleted {time.perf_counter() - t:.1f}s)"
    ix.set_ef(param_at(res))
    after = truth_after_delete(cfg, base, extra, queries, gone)
    found = np.stack([ix.knn_query(q[None, :], 10)[0][0] for q in queries])
    res.recall_after_delete = recall_at(found, after)
    return res


def run_exact(cfg, base, extra, queries, truth, log) -> AnnResult:
    """faiss IndexFlatIP when faiss is there (as the anchors), else a numpy scan."""
    try:
        import faiss
    except ImportError:
        faiss = None
    t = time.perf_counter()
    if faiss is not None:
        res = AnnResult("exact (faiss IndexFlatIP)", "(float32)")
        ix = faiss.IndexFlatIP(cfg.dim)
        ix.add(base)
        faiss.omp_set_num_threads(1)
        search = lambda q: ix.search(q[None, :], 10)[1][0]  # noqa: E731
    else:
        res = AnnResult("exact (numpy scan)", "(float32)")
        block = np.ascontiguousarray(base)
        search = lambda q: np.argpartition(-(block @ q), 10)[:10]  # noqa: E731
    res.build_s = time.perf_counter() - t
    res.bytes_per_vector = base.nbytes / cfg.n
    if cfg.n > 200_000:  # a full scan per query: time a subset
        queries, truth = queries[: cfg.exact_queries], truth[: cfg.exact_queries]
    res.sweep = sweep(search, lambda p: None, ("-",), queries, truth)
    yield Timed(res, search, lambda p: None, queries)
    return res


RUNNERS = {
    "kvmem-graph": run_graph,
    "faiss-hnsw": run_faiss_hnsw,
    "faiss-ivf-rabitq": run_faiss_ivf_rabitq,
    "hnswlib": run_hnswlib,
    "exact": run_exact,
}
