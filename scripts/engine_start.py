"""vLLM start-up and request time on this host, eager against compiled, side by side in one run.

    .venv/bin/python scripts/engine_start.py

Each variant starts the bundled model's engine in a fresh subprocess (KVMEM_ENFORCE_EAGER=1, then
=0), times the start and two requests (a 300-token prefill + 32 decoded tokens), and the ratios
are printed at the end. This is the measurement behind EngineConfig.enforce_eager=None (eager on
CPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

CHILD = """
import json, time, tempfile
from dataclasses import replace
from pathlib import Path
from kvmem.config import Config, default_home
from kvmem.engine.llm import LocalEngine
from kvmem.engine.protocol import EngineRequest
from kvmem.model import resolve_model

def main():
    config = replace(Config.from_env(), home=Path(tempfile.mkdtemp()), models_home=default_home() / "models")
    model = resolve_model(None, default_home() / "models")
    t0 = time.perf_counter()
    engine = LocalEngine(model, config)
    started = time.perf_counter() - t0
    times = []
    for first in (100, 500):
        t = time.perf_counter()
        engine.run([EngineRequest(tuple(range(first, first + 300)), "bench", 32)])
        times.append(time.perf_counter() - t)
    engine.close()
    print("RESULT " + json.dumps({"start_s": started, "request_s": times}))

if __name__ == "__main__":
    main()
"""


def run(eager: str) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(CHILD)
    env = {**os.environ, "KVMEM_ENFORCE_EAGER": eager, "VLLM_LOGGING_LEVEL": "WARNING"}
    print(f"starting the engine with KVMEM_ENFORCE_EAGER={eager} ...", flush=True)
    out = subprocess.run([sys.executable, f.name], env=env, capture_output=True, text=True, timeout=1800)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"the child failed:\n{out.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def main() -> None:
    started = time.time()
    eager, compiled = run("1"), run("0")
    for name, r in (("eager", eager), ("compiled", compiled)):
        print(f"{name:9s} start {r['start_s']:6.1f} s   requests {', '.join(f'{t:.2f}' for t in r['request_s'])} s")
    print(f"compiled/eager: start {compiled['start_s'] / eager['start_s']:.2f}x, "
          f"second request {compiled['request_s'][1] / eager['request_s'][1]:.2f}x "
          f"({time.time() - started:.0f} s in all)")


if __name__ == "__main__":
    main()
