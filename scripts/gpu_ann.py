"""Graph index build and batch search on a CUDA device with CuPy, beside the CPU index.

    python scripts/gpu_ann.py [--n 100000] [--dim 384] [--queries 10000] [--out docs/results/ann-gpu.json]

Build (GPU): exact 2R-NN lists by tiled matrix products, RobustPrune (alpha) batched over
nodes, reverse edges merged and pruned again: a Vamana-shaped graph of out-degree <= R built
in a few large array operations (the CAGRA recipe) instead of Jasper's incremental batches.
Search (GPU): one CUDA thread per query walks the graph with a beam of L on exact float32
inner products (RawKernel below), so a batch of queries runs at once.
The same data is built and searched by kvmem's CPU graph (kvmem/index/vamana.py) for the
comparison, and the GPU-built graph is also searched by the CPU walk (RaBitQ-guided), which
checks that the GPU graph is a drop-in for the CPU one.

`--cpu` runs the array code on NumPy instead (no GPU search): the way this script is tested
on machines without a device. Needs cupy (cupy-cuda12x) for the GPU path; no vLLM.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvmem.bench.ann import AnnConfig, clustered, exact_top, recall_at  # noqa: E402
from kvmem.index.rabitq import RaBitQ  # noqa: E402
from kvmem.index.vamana import GraphParams, VamanaGraph  # noqa: E402

SEARCH_KERNEL = r"""
extern "C" __global__ void beam_search(
    const float* __restrict__ X, const int* __restrict__ adj, const int* __restrict__ deg,
    const float* __restrict__ Q, int n_queries, int dim, int width, int entry, int L, int k,
    int* __restrict__ out_ids, float* __restrict__ out_scores)
{
    const int MAXL = 128, HASH = 4096;
    int qi = blockIdx.x * blockDim.x + threadIdx.x;
    if (qi >= n_queries) return;
    const float* q = Q + (size_t)qi * dim;
    int ids[MAXL]; float sc[MAXL]; unsigned char done[MAXL];
    int seen[HASH];
    for (int i = 0; i < HASH; ++i) seen[i] = -1;
    if (L > MAXL) L = MAXL;
    float s = 0.f;
    for (int j = 0; j < dim; ++j) s += X[(size_t)entry * dim + j] * q[j];
    ids[0] = entry; sc[0] = s; done[0] = 0; int size = 1;
    seen[(entry * 2654435761u) & (HASH - 1)] = entry;
    int cur = 0;
    while (cur < size) {
        int node = ids[cur]; done[cur] = 1;
        int best = size;
        for (int e = 0; e < deg[node]; ++e) {
            int nb = adj[(size_t)node * width + e];
            unsigned h = (nb * 2654435761u) & (HASH - 1);
            bool visited = false;
            while (seen[h] != -1) { if (seen[h] == nb) { visited = true; break; } h = (h + 1) & (HASH - 1); }
            if (visited) continue;
            seen[h] = nb;
            float d = 0.f;
            const float* x = X + (size_t)nb * dim;
            for (int j = 0; j < dim; ++j) d += x[j] * q[j];
            if (size == L && d <= sc[size - 1]) continue;
            int pos = size < L ? size : L - 1;
            while (pos > 0 && sc[pos - 1] < d) { ids[pos] = ids[pos - 1]; sc[pos] = sc[pos - 1]; done[pos] = done[pos - 1]; --pos; }
            ids[pos] = nb; sc[pos] = d; done[pos] = 0;
            if (size < L) ++size;
            if (pos < best) best = pos;
        }
        if (best < cur) cur = best;
        while (cur < size && done[cur]) ++cur;
    }
    for (int i = 0; i < k; ++i) {
        out_ids[(size_t)qi * k + i] = i < size ? ids[i] : -1;
        out_scores[(size_t)qi * k + i] = i < size ? sc[i] : -1e30f;
    }
}
"""


def knn_lists(xp, X, width: int, tile: int = 4096):
    """Exact `width` nearest ids [n, width] and inner products, best first, by tiled X @ X.T."""
    n = X.shape[0]
    ids = xp.empty((n, width), xp.int32)
    ips = xp.empty((n, width), xp.float32)
    for lo in range(0, n, tile):
        s = X[lo: lo + tile] @ X.T  # [b, n]
        s[xp.arange(s.shape[0]), xp.arange(lo, lo + s.shape[0])] = -xp.inf  # not its own neighbour
        order = xp.argsort(-s, axis=1)[:, :width]  # [b, width]
        ids[lo: lo + tile] = order
        ips[lo: lo + tile] = xp.take_along_axis(s, order, 1)
    return ids, ips


def batched_prune(xp, X, cand, cand_ip, degree: int, alpha: float, tile: int = 8192):
    """RobustPrune for every node at once: cand [n, m] sorted by descending ip -> [n, degree] (-1 pads)."""
    n, m = cand.shape
    out = xp.full((n, degree), -1, xp.int32)
    for lo in range(0, n, tile):
        c = cand[lo: lo + tile]  # [b, m]
        valid = c >= 0
        d_p = 2 - 2 * cand_ip[lo: lo + tile]  # [b, m]
        v = X[xp.maximum(c, 0)]  # [b, m, dim]
        d_cc = 2 - 2 * xp.matmul(v, v.transpose(0, 2, 1))  # [b, m, m]
        alive = valid.copy()
        count = xp.zeros(c.shape[0], xp.int32)
        rows = xp.arange(c.shape[0])
        for i in range(m):
            take = alive[:, i] & (count < degree)  # [b]
            out[lo + rows[take], count[take]] = c[take, i]
            count += take
            alive &= ~(take[:, None] & (alpha * d_cc[:, i, :] <= d_p))
            alive[:, i] = False
    return out


def gpu_build(xp, X, params: GraphParams):
    """A Vamana-shaped graph [n, R]: kNN lists, pruned, reverse edges merged and re-pruned.

    Pure kNN lists stay inside clusters (islands a walk from the medoid never leaves): R/4
    random nodes join each node's candidates, and RobustPrune keeps the far ones (no nearer
    neighbour covers them): the long edges the incremental build gets from its early,
    sparse graph.
    """
    R = params.degree
    n = X.shape[0]
    cand, ip = knn_lists(xp, X, 2 * R)
    rand = xp.asarray(np.random.default_rng(params.seed).integers(0, n, (n, R // 4)), dtype=xp.int32)
    rand_ip = xp.sum(X[rand] * X[:, None, :], axis=2)  # [n, R/4]
    rand_ip = xp.where(rand == xp.arange(n)[:, None], -xp.inf, rand_ip)
    cand = xp.concatenate([cand, rand], axis=1)
    ip = xp.concatenate([ip, rand_ip], axis=1)
    ip = xp.where(_first_occurrence(xp, cand), ip, -xp.inf)
    order = xp.argsort(-ip, axis=1)
    ip = xp.take_along_axis(ip, order, 1)
    cand = xp.where(xp.isfinite(ip), xp.take_along_axis(cand, order, 1), -1)
    out = batched_prune(xp, X, cand, ip, R, params.alpha)
    src = xp.repeat(xp.arange(X.shape[0], dtype=xp.int32), R)
    dst = out.reshape(-1)
    keep = dst >= 0
    src, dst = src[keep], dst[keep]
    # each node: its own out-edges plus up to R incoming ones (nearest first), pruned again
    ips = xp.sum(X[src] * X[dst], axis=1)
    order = xp.lexsort(xp.stack([-ips, dst]))
    src, dst, ips = src[order], dst[order], ips[order]
    starts = xp.searchsorted(dst, xp.arange(X.shape[0]))
    rank = xp.arange(len(dst)) - starts[dst]
    incoming = xp.full((X.shape[0], R), -1, xp.int32)
    sel = rank < R
    incoming[dst[sel], rank[sel]] = src[sel]
    merged = xp.concatenate([out, incoming], axis=1)  # [n, 2R], may repeat
    merged_ip = xp.where(merged >= 0, xp.sum(X[xp.maximum(merged, 0)] * X[:, None, :], axis=2), -xp.inf)
    merged_ip = xp.where(_first_occurrence(xp, merged), merged_ip, -xp.inf)
    order = xp.argsort(-merged_ip, axis=1)
    merged = xp.where(xp.isfinite(xp.take_along_axis(merged_ip, order, 1)), xp.take_along_axis(merged, order, 1), -1)
    return batched_prune(xp, X, merged, xp.sort(merged_ip, axis=1)[:, ::-1], R, params.alpha)


def _first_occurrence(xp, a):
    """[n, m] mask: True where a[i, j] >= 0 does not occur earlier in row i."""
    eq = a[:, :, None] == a[:, None, :]  # [n, m, m]
    earlier = xp.tril(xp.ones(eq.shape[1:], bool), -1)
    return (a >= 0) & ~xp.any(eq & earlier, axis=2)


def as_cpu_graph(X: np.ndarray, adj: np.ndarray, params: GraphParams) -> VamanaGraph:
    """Wrap a GPU-built adjacency [n, R] as a kvmem VamanaGraph (RaBitQ codes computed here)."""
    quant = RaBitQ.fit(X, params.seed)
    codes, factors = quant.encode(X)
    width = VamanaGraph(X.shape[1], params).row
    full = np.full((len(X), width), 0, np.int32)
    degs = (adj >= 0).sum(1).astype(np.int32)
    full[:, : adj.shape[1]] = np.where(adj >= 0, adj, 0)
    entry = int(np.argmax(X @ quant.centroid))  # the medoid, as the CPU build picks it
    state = {"vectors": X, "codes": codes, "factors": factors, "adj": full, "deg": degs,
             "deleted": np.zeros(len(X), np.uint8), "free": np.zeros(0, np.int64),
             "meta": np.asarray([X.shape[1], len(X), entry], np.int64), "signs": quant.signs,
             "centroid": quant.centroid}
    return VamanaGraph.from_state(state, params)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--queries", type=int, default=10_000)
    ap.add_argument("--beams", type=lambda s: [int(x) for x in s.split(",")], default=[16, 32, 64, 128])
    ap.add_argument("--cpu", action="store_true", help="NumPy instead of CuPy (tests the build code only)")
    ap.add_argument("--out", type=Path, default=Path("docs/results/ann-gpu.json"))
    args = ap.parse_args()
    if args.cpu:
        xp = np
    else:
        import cupy as xp
    cfg = AnnConfig(n=args.n, dim=args.dim, queries=args.queries, centres=max(1, args.n // 100), extra=0)
    base, _, queries = clustered(cfg)
    truth = exact_top(base, queries, 10)
    params = GraphParams(threads=2)
    result: dict = {"n": args.n, "dim": args.dim, "queries": args.queries, "device": "cpu-numpy" if args.cpu else _device(xp)}

    t = time.perf_counter()
    cpu = VamanaGraph(args.dim, params)
    cpu.add(base)
    result["cpu_build_s"] = time.perf_counter() - t
    X = xp.asarray(base)
    _sync(xp)
    t = time.perf_counter()
    adj = gpu_build(xp, X, params)
    _sync(xp)
    result["gpu_build_s"] = time.perf_counter() - t
    adj_host = adj.get() if hasattr(adj, "get") else adj
    gpu_graph = as_cpu_graph(base, adj_host, params)

    result["search"] = []
    for beam in args.beams:
        row = {"beam": beam}
        for name, g in (("cpu_graph", cpu), ("gpu_graph", gpu_graph)):
            t = time.perf_counter()
            ids, _ = g.search_many(queries, 10, beam)
            row[f"{name}_cpu_walk_qps"] = len(queries) / (time.perf_counter() - t)
            row[f"{name}_cpu_walk_recall"] = recall_at(ids, truth)
        if not args.cpu:
            for name, g in (("cpu_graph", cpu), ("gpu_graph", gpu_graph)):
                ids, qps = gpu_search(xp, X, g, xp.asarray(queries), beam)
                row[f"{name}_gpu_walk_qps"] = qps
                row[f"{name}_gpu_walk_recall"] = recall_at(ids, truth)
        result["search"].append(row)
        print(json.dumps(row))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "search"}))
    return 0


def gpu_search(xp, X, g: VamanaGraph, Q, beam: int, k: int = 10) -> tuple[np.ndarray, float]:
    """Batch beam search on the device over graph g; returns ids [m, k] and queries/s."""
    kernel = xp.RawKernel(SEARCH_KERNEL, "beam_search")
    adj = xp.asarray(g.adj[: g.size])
    deg = xp.asarray(g.deg[: g.size])
    m = Q.shape[0]
    ids = xp.empty((m, k), xp.int32)
    scores = xp.empty((m, k), xp.float32)
    threads = 128
    grid = ((m + threads - 1) // threads,)
    call = (X, adj, deg, Q, np.int32(m), np.int32(X.shape[1]), np.int32(adj.shape[1]), np.int32(g.entry),
            np.int32(max(beam, k)), np.int32(k), ids, scores)
    kernel(grid, (threads,), call)  # warm (compiles)
    _sync(xp)
    t = time.perf_counter()
    kernel(grid, (threads,), call)
    _sync(xp)
    return ids.get(), m / (time.perf_counter() - t)


def _sync(xp) -> None:
    if xp is not np:
        xp.cuda.Stream.null.synchronize()


def _device(xp) -> str:
    props = xp.cuda.runtime.getDeviceProperties(0)
    return props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])


if __name__ == "__main__":
    raise SystemExit(main())
