"""How the graph's build parameters (out-degree R, build beam L) move its recall-vs-beam curve.

One data set (`kvmem bench ann`'s clustered vectors), one graph per R x L, each built the way
the bench builds it (90% as one add, the last 10% as a timed batch) and swept over search beams
(best-of-3 single-thread QPS per beam, as the bench sweeps). The graphs are built one after
another, so compare recall across rows freely and QPS only roughly (this shared VM's speed drifts
by tens of percent within minutes; `kvmem bench ann` interleaves its timings for that reason).

    .venv/bin/python scripts/ann_params.py -n 100000 --centres 1000 --grid 32x48,48x64 \
        --beams 16,20,24,28,32 --out /tmp/ann-params.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from kvmem.bench.ann import AnnConfig, _pad, clustered, exact_top, sweep
from kvmem.index.vamana import GraphParams, VamanaGraph


def run(n: int, centres: int, grid: list[tuple[int, int]], beams: tuple[int, ...]) -> list[dict]:
    cfg = AnnConfig(n=n, centres=centres)
    base, _, queries = clustered(cfg)
    truth = exact_top(base, queries, 10)
    warm = VamanaGraph(cfg.dim, GraphParams())  # numba kernels load outside the timings
    warm.add(base[:500])
    warm.search(queries[0], 10)
    rows = []
    for degree, build_beam in grid:
        g = VamanaGraph(cfg.dim, GraphParams(degree=degree, build_beam=build_beam, threads=cfg.threads))
        head = int(n * 0.9)
        t0 = time.perf_counter()
        g.add(base[:head])
        t1 = time.perf_counter()
        g.add(base[head:])
        t2 = time.perf_counter()
        beam = [10]
        curve = sweep(lambda q: _pad(g.search(q, 10, beam[0])[0]), lambda p: beam.__setitem__(0, p), beams,
                      queries, truth)
        rows.append({"R": degree, "L": build_beam, "default_beam": g.default_beam(), "build_s": t2 - t0, "insert_batch_vps": (n - head) / (t2 - t1),
                     "bytes_per_vector": sum(a.nbytes for a in g.state().values()) / n, "sweep": curve})
        print(f"R{degree} L{build_beam}: build {t2 - t0:.1f} s, batch inserts {rows[-1]['insert_batch_vps']:.0f} v/s,",
              " ".join(f"{s['param']}:{s['recall']:.3f}/{s['qps1']:.0f}" for s in curve), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", type=int, default=100_000)
    ap.add_argument("--centres", type=int, default=1_000)
    ap.add_argument("--grid", default="32x48,48x64", help="comma-separated RxL pairs")
    ap.add_argument("--beams", default="16,20,24,28,32,36", help="search beams; 0 = the graph's default beam")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    grid = [tuple(int(v) for v in pair.split("x")) for pair in args.grid.split(",")]
    rows = run(args.n, args.centres, grid, tuple(int(b) for b in args.beams.split(",")))
    args.out.write_text(json.dumps({"n": args.n, "centres": args.centres, "graphs": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
