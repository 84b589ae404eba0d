"""How `kvmem bench ann` measures an index: its results record, the exact ground truth, recall,
the parameter sweep, QPS with 1 and 2 threads, and the interleaved timing rounds.

Kept apart from the runners and the report (kvmem.bench.ann) so that each runner is only the
library calls that differ between indexes, and the timing rules are written once for all.
"""

from __future__ import annotations

import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

TARGET_RECALL = 0.95
PASSES = 3  # QPS is the best of this many passes: a shared machine only ever slows a pass down


@dataclass(frozen=True)
class AnnConfig:
    n: int = 100_000
    dim: int = 384
    queries: int = 1_000
    centres: int = 1_000
    extra: int = 1_000  # inserted one at a time after the build
    batch_tail: float = 0.1  # the build's last 10% goes in as one timed batch
    delete_share: float = 0.1
    threads: int = 2  # build threads; search is always 1 thread, one query per call
    seed: int = 0
    indexes: tuple[str, ...] = ("kvmem-graph", "faiss-hnsw", "faiss-ivf-rabitq", "hnswlib", "exact")
    data: str = "clustered"  # or "locomo": MiniLM embeddings of the turns and questions at `locomo`
    locomo: str = ""  # LoCoMo JSON path (data="locomo"); n, extra and queries then come from it
    name: str = "ann"  # results go to <out>/<name>.json and <name>.png
    exact_queries: int = 100  # the exact scan is timed on this many queries when n > 200k
    rounds: int = 5  # interleaved timing rounds at each index's recall-0.95 parameter
    filtered: bool = True  # also time GraphIndex under 1%, 10% and 50% filters


@dataclass
class AnnResult:
    name: str
    params: str
    build_s: float = float("nan")
    bytes_per_vector: float = float("nan")
    sweep: list[dict] = field(default_factory=list)  # {param, recall, qps1}
    qps1: float = float("nan")  # 1 thread, one query per call, at the parameter of qps_at(0.95): the
    qps2: float = float("nan")  # median over interleaved rounds (see `interleave`); qps2: 2 threads
    insert_batch_vps: float = float("nan")
    insert_one_vps: float = float("nan")
    recall_after_delete: float | None = None
    delete_note: str = ""

    def qps_at(self, recall: float) -> tuple[float, object] | None:
        """QPS (1 thread) at the smallest swept parameter reaching `recall`."""
        ok = [s for s in self.sweep if s["recall"] >= recall]
        return (ok[0]["qps1"], ok[0]["param"]) if ok else None


def exact_top(base: np.ndarray, queries: np.ndarray, k: int, alive: np.ndarray | None = None) -> np.ndarray:
    """Exact top-k ids [q, k] by inner product, in chunks to bound memory."""
    out = np.empty((len(queries), k), np.int64)
    for lo in range(0, len(queries), 256):
        s = queries[lo: lo + 256] @ base.T  # [b, n]
        if alive is not None:
            s[:, ~alive] = -np.inf
        part = np.argpartition(-s, k, axis=1)[:, :k]  # [b, k]
        order = np.argsort(-np.take_along_axis(s, part, 1), axis=1)
        out[lo: lo + 256] = np.take_along_axis(part, order, 1)
    return out


def recall_at(found: np.ndarray, truth: np.ndarray) -> float:
    """Mean |found ∩ truth| / k over queries; found [q, k] may hold -1 pads."""
    return float(np.mean([len(set(f.tolist()) & set(t.tolist())) / truth.shape[1] for f, t in zip(found, truth)]))


def sweep(search_one, set_param, params, queries: np.ndarray, truth: np.ndarray) -> list[dict]:
    """Recall and single-thread QPS per parameter; stops once recall passes 0.995."""
    rows = []
    for p in params:
        set_param(p)
        search_one(queries[0])  # warm
        best = float("inf")
        for _ in range(PASSES):
            t = time.perf_counter()
            found = np.stack([search_one(q) for q in queries])  # [q, k]
            best = min(best, time.perf_counter() - t)
        rows.append({"param": p, "recall": recall_at(found, truth), "qps1": len(queries) / best})
        if rows[-1]["recall"] >= 0.995:
            break
    return rows


def qps_threads(search_one, queries: np.ndarray, threads: int = 2, passes: int = PASSES) -> float:
    """Queries/s with `threads` Python threads, each searching its share one query per call.

    Every index here releases the GIL while it searches, so the threads run side by side.
    """
    parts = np.array_split(queries, threads)
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(passes):
            t = time.perf_counter()
            list(pool.map(lambda part: [search_one(q) for q in part], parts))
            best = min(best, time.perf_counter() - t)
    return len(queries) / best


@dataclass
class Timed:
    """A built index, paused by its runner between the sweep and the writes, for `interleave`."""

    res: AnnResult
    search_one: object
    set_param: object
    queries: np.ndarray


def interleave(timed: list[Timed], rounds: int, log=print) -> None:
    """QPS1 and QPS2 of every index at its recall-0.95 parameter, timed in turn, round after round.

    On a shared machine a slow minute hits whichever index runs in it; taking turns spreads such
    minutes over all of them, and the median over rounds drops the worst ones.
    """
    one = {id(t): [] for t in timed}
    two = {id(t): [] for t in timed}
    for r in range(rounds):
        for t in timed:
            t.set_param(param_at(t.res))
            one[id(t)].append(qps_threads(t.search_one, t.queries, threads=1, passes=1))
            two[id(t)].append(qps_threads(t.search_one, t.queries, threads=2, passes=1))
        log(f"interleaved round {r + 1}/{rounds}: " + ", ".join(f"{t.res.name} {one[id(t)][-1]:.0f}" for t in timed))
    for t in timed:
        t.res.qps1, t.res.qps2 = float(np.median(one[id(t)])), float(np.median(two[id(t)]))


def param_at(res: AnnResult):
    """The swept parameter that first reached TARGET_RECALL, else the last one tried (the best recall)."""
    at = res.qps_at(TARGET_RECALL)
    return at[1] if at else res.sweep[-1]["param"]


def timed_build(res: AnnResult, cfg: AnnConfig, add, base: np.ndarray) -> None:
    """Build with `add` in two calls: the whole build is timed, and its last batch_tail alone
    gives the batched insert rate into an index that is already large."""
    head = int(cfg.n * (1 - cfg.batch_tail))
    t0 = time.perf_counter()
    add(base[:head])
    t1 = time.perf_counter()
    add(base[head:])
    t2 = time.perf_counter()
    res.build_s, res.insert_batch_vps = t2 - t0, (cfg.n - head) / (t2 - t1)


def delete_ids(cfg: AnnConfig) -> np.ndarray:
    """The base ids every index deletes: seeded, so all of them lose the same vectors."""
    rng = np.random.default_rng(cfg.seed + 1)
    return np.sort(rng.choice(cfg.n, int(cfg.n * cfg.delete_share), replace=False))


def truth_after_delete(cfg, base, extra, queries, gone) -> np.ndarray:
    """Exact top-10 over base + extra without the deleted ids."""
    alive = np.ones(cfg.n + cfg.extra, bool)
    alive[gone] = False
    return exact_top(np.vstack([base, extra]), queries, 10, alive)


def temp_size(save) -> int:
    """Bytes written by save(path) to a temporary file."""
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "index")
        save(p)
        return os.path.getsize(p)
