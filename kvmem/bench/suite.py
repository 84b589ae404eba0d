"""`python -m kvmem.bench.suite`: every benchmark and evaluation behind docs/benchmarks.md, in one
process (one engine start instead of one per command). Same code paths as `kvmem bench ...`
and `kvmem eval locomo ...`; results go to docs/results/.

    python -m kvmem.bench.suite [--home DIR] [--limit N] [--skip eval,windows,ttft,load]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvmem.bench import eval_locomo, eval_report, load, locomo, ttft
from kvmem.config import Config
from kvmem.config_overlay import add_common_options, from_args

OUT = Path("docs/results")
SUITE_HOME = Path("/tmp/kvmem-bench-suite")  # a data folder of its own, not the user's memory


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvmem.bench.suite", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_options(ap, suppress=False)  # --home, --models-home, --model, --config, as every command
    ap.add_argument("--limit", type=int, default=40, help="LoCoMo questions per conversation (default: 40)")
    ap.add_argument("--windows", default="0,1,2,4", help="CWE windows to compare on turn memory")
    ap.add_argument("--window-conversations", default="conv-26,conv-30,conv-41",
                    help="conversations for the window comparison")
    ap.add_argument("--window-limit", type=int, default=30, help="questions per conversation there (default: 30)")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: eval,windows,ttft,load")
    args = ap.parse_args(argv)
    args.home = args.home or SUITE_HOME
    skip = set(args.skip.split(","))
    from kvmem.service import KVMem

    OUT.mkdir(parents=True, exist_ok=True)
    config = from_args(args).config
    with KVMem(config, background=False) as mem:
        if "eval" not in skip:
            _eval(mem, eval_locomo.EvalConfig(locomo.DEFAULT_PATH, k=10, limit=args.limit), config)
        if "windows" not in skip:
            convs = tuple(c for c in args.window_conversations.split(",") if c)
            for w in (int(x) for x in args.windows.split(",")):
                _eval(mem, eval_locomo.EvalConfig(locomo.DEFAULT_PATH, convs, k=10, memory="turns", window=w,
                                                  limit=args.window_limit), config)
        if "ttft" not in skip:
            print(ttft.report(ttft.run(mem, data=locomo.DEFAULT_PATH), OUT / "ttft"), flush=True)
        if "load" not in skip:
            print(load.report(load.run(mem, data=locomo.DEFAULT_PATH), OUT / "load"), flush=True)
    return 0


def _eval(mem, cfg: eval_locomo.EvalConfig, config: Config) -> None:
    rows = eval_locomo.run(mem, cfg, config.home / "eval")
    print(eval_report.write(rows, cfg, OUT), flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
