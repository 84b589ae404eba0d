"""Cold-process timings of the no-engine commands on a home with 10,000 facts (issue 43).

    .venv/bin/python scripts/cli_cold.py [--facts 10000] [--repeat 3] [--out docs/results/cli-cold.txt]
                                         [--home DIR]   # keep the built home there; reuse it next time

Builds the home the way an operator would fill one without an engine: a generated JSON-lines file
through `kvmem import` (facts embedded, KV left pending), then a few updates and deletes so that
history and deleted facts exist. Then times fresh `kvmem list | get | search | history | stats |
export` processes, each started from nothing (no warm Python), with an empty --models-home: a
command that resolved the chat model would convert it there (minutes), so the folder must still
be empty at the end, and each command's process is asked which modules it loaded.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KVMEM = [sys.executable, "-m", "kvmem.cli"]
NAMES = ["Ana", "Bruno", "Carla", "Diego", "Eva", "Filipe", "Gina", "Hugo", "Inês", "João", "Marta", "Rui"]
RELATIONS = ["sister", "brother", "friend", "neighbour", "colleague", "cousin", "dentist", "coach"]
PLACES = ["Braga", "Lisbon", "Porto", "Faro", "Coimbra", "Évora", "Aveiro", "Sintra", "Madrid", "Paris"]
HOBBIES = ["the violin", "trail running", "pottery", "chess", "surfing", "baking bread", "birdwatching",
           "salsa", "climbing", "knitting", "sailing", "photography"]
# Asked in a child process after the command ran: was the engine, vLLM or the service facade loaded?
PROBE = ("import sys\n"
         "from kvmem.cli import main\nrc = main(sys.argv[1:])\n"
         "heavy = sorted(m for m in sys.modules if m.split('.')[0] == 'vllm' or m in "
         "('kvmem.service', 'kvmem.engine', 'kvmem.chat', 'kvmem.encoding'))\n"
         "print('LOADED', heavy, file=sys.stderr); sys.exit(rc)\n")


def fact_lines(n: int, rng: random.Random) -> list[str]:
    """n distinct facts: 60% for user ops-user (the one timed), the rest over 40 other users."""
    lines, seen = [], set()
    t0 = time.time() - 86_400 * 30
    while len(lines) < n:
        user = "ops-user" if len(lines) < n * 6 // 10 else f"user-{len(lines) % 40:02d}"
        text = (f"My {rng.choice(RELATIONS)} {rng.choice(NAMES)} lives in {rng.choice(PLACES)} and loves "
                f"{rng.choice(HOBBIES)} (note {rng.randrange(10**6)}).")
        if (user, text) in seen:
            continue
        seen.add((user, text))
        lines.append(json.dumps({"user_id": user, "text": text, "metadata": {"topic": rng.choice(HOBBIES)},
                                 "origin": f"said on day {len(lines) % 30}", "created_at": t0 + len(lines)}))
    return lines


def run(args: list[str], env: dict[str, str], probe: bool = False) -> tuple[float, float, str, str]:
    """(wall seconds, CPU seconds, stdout, stderr) of one fresh process; fails loudly on a non-zero
    exit. CPU time (user + system) is the steadier number on a shared host: wall time also counts
    waiting for the cores."""
    argv = [sys.executable, "-c", PROBE, *args] if probe else [*KVMEM, *args]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return seconds, cpu, done.stdout, done.stderr


def build(home: Path, n: int, common: list[str], env: dict[str, str]) -> list[str]:
    rng = random.Random(43)
    source = home.parent / "facts.jsonl"
    source.write_text("\n".join(fact_lines(n, rng)) + "\n", encoding="utf-8")
    seconds, _, out, _ = run([*common, "import", str(source)], env)
    report = [f"built: kvmem import of {n} generated facts in {seconds:.1f} s (embedded; KV left pending)",
              "  " + out.strip().splitlines()[0]]
    out = run([*common, "list", "--user", "ops-user", "--limit", "20", "--json"], env)[2]
    ids = [json.loads(line)["id"] for line in out.splitlines()]
    for fact_id in ids[:5]:
        run([*common, "update", fact_id, "--metadata", '{"topic": "edited"}'], env)
    run([*common, "forget", "--user", "ops-user", *ids[5:10]], env)
    return report


def measure(common: list[str], env: dict[str, str], fact_id: str, repeat: int, export: Path) -> list[str]:
    commands = {
        "kvmem --help (Python + the command table)": ["--help"],
        "kvmem list --user ops-user (first 100)": [*common, "list", "--user", "ops-user"],
        "kvmem list (all users, 1000 per page)": [*common, "list", "--limit", "1000"],
        "kvmem get ID": [*common, "get", fact_id],
        "kvmem history ID": [*common, "history", fact_id],
        "kvmem search --user ops-user QUERY": [*common, "search", "--user", "ops-user", "Who plays the violin?"],
        "kvmem stats": [*common, "stats"],
        "kvmem export --all (to a file)": [*common, "export", "--all", "-o", str(export)],
    }
    lines = [f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
             f"{'command':44} {'wall s, each run':>22} {'best':>6} {'cpu s, best':>12}"]
    for name, args in commands.items():
        runs = [run(args, env)[:2] for _ in range(repeat)]
        walls = [wall for wall, _ in runs]
        lines.append(f"{name:44} {' '.join(f'{t:6.2f}' for t in walls):>22} {min(walls):6.2f} "
                     f"{min(cpu for _, cpu in runs):12.2f}")
    lines.append(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for args in (["list", "--user", "ops-user"], ["get", fact_id], ["search", "--user", "ops-user", "violin"],
                 ["history", fact_id], ["stats"]):
        err = run([*common, *args], env, probe=True)[3]
        lines.append(f"modules of the engine/vLLM/service loaded by `kvmem {args[0]}`: "
                     + err.strip().splitlines()[-1].removeprefix("LOADED "))
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--facts", type=int, default=10_000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "docs" / "results" / "cli-cold.txt"))
    p.add_argument("--home", type=Path, help="build the home here and keep it; reused if it has facts already")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvmem-cold-") as tmp:
        home, models = args.home or Path(tmp) / "home", Path(tmp) / "models-empty"
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        env.pop("KVMEM_HOME", None)
        common = ["--home", str(home), "--models-home", str(models)]
        # update and forget resolve the model (tokenizer, fingerprint): give them the shared cache.
        shared = ["--home", str(home)]
        built = (home / "facts.sqlite").is_file()
        report = [f"reused the home built earlier at {home}"] if built else build(home, args.facts, shared, env)
        fact_id = pick_fact(report, home)
        lines = measure(common, env, fact_id, args.repeat, Path(tmp) / "export.jsonl")
        lines += search_phases(home, env)
        untouched = not models.exists() or not any(models.iterdir())
        lines.append(f"--models-home left empty (no model resolved or converted): {untouched}")
    header = [f"# scripts/cli_cold.py, {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, "
              f"{args.facts} facts, {args.repeat} cold processes per command", *report, ""]
    text = "\n".join([*header, *lines]) + "\n"
    print(text, end="")
    Path(args.out).write_text(text, encoding="utf-8")
    return 0


# Where a cold search's time goes, phase by phase, in one fresh process (what `kvmem search` does).
PHASES = """
import sys, threading, time
marks = [("start", time.perf_counter())]
def mark(name): marks.append((name, time.perf_counter()))
import kvmem.cli; kvmem.cli.build_parser(); mark("kvmem's command table (no torch, no transformers)")
from kvmem.config import Config
from kvmem.embed.numpy_minilm import NumpyMiniLMEmbedder
from kvmem.facts import FactStore
from kvmem.retrieval import Retrieval
store = FactStore(sys.argv[1] + "/facts.sqlite")
embedder = NumpyMiniLMEmbedder()
retrieval = Retrieval(store, embedder, Config().retrieval, threading.RLock())
mark("dense and word indexes of every fact built from the store")
embedder.embed(["warm up"]); mark("query embedder loaded (NumPy MiniLM) + first forward")
retrieval.search("Who plays the violin?", user_id="ops-user"); mark("the search itself (query embedded, ranked)")
for (_, a), (name, b) in zip(marks, marks[1:]):
    print(f"  {b - a:5.2f} s  {name}")
print(f"  {marks[-1][1] - marks[0][1]:5.2f} s  in all (plus ~0.05 s of interpreter start)")
"""


def search_phases(home: Path, env: dict[str, str]) -> list[str]:
    done = subprocess.run([sys.executable, "-c", PHASES, str(home)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    return ["a cold search, phase by phase (one process):", *done.stdout.splitlines()]


def pick_fact(report: list[str], home: Path) -> str:
    """A stored fact of ops-user to get (read from the store directly, not through the CLI)."""
    from kvmem.facts import FactStore

    with FactStore(home / "facts.sqlite") as store:
        report.append(f"home: {store.count()} facts, {store.tally()['deleted_facts']} deleted, "
                      f"{(home / 'facts.sqlite').stat().st_size / 2**20:.1f} MiB facts.sqlite")
        return store.list(user_id="ops-user", limit=1, offset=100)[0].id


if __name__ == "__main__":
    sys.exit(main())
