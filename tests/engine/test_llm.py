"""Starting the engine from a user's own script (kvmem/engine/llm.py)."""

from __future__ import annotations

import multiprocessing.spawn
import subprocess
import sys
import textwrap

import pytest

from kvmem.config import default_home
from kvmem.engine.llm import _children_skip_main_script

# docs/usage.md's Python example as a user would save it. It imports numba first, as a user's script
# may: kvmem's index loads it too, but only the script's own imports are run again in a child.
SCRIPT = """
import numba  # noqa: F401
from pathlib import Path
from kvmem.config import Config
from kvmem.service import KVMem

def main():
    config = Config(home=Path({home!r}), models_home=Path({models!r}))
    with KVMem(config, background=False) as mem:
        mem.add(facts=["I am allergic to penicillin."], user_id="alice")
        r = mem.chat("What am I allergic to?", user_id="alice", k=1, mode="kv", max_tokens=8)
        print("ANSWER", r.injected_tokens, r.answer)

{call}
"""


def test_spawned_children_are_not_told_of_a_main_script():
    main = sys.modules["__main__"]
    before = (getattr(main, "__file__", None), getattr(main, "__spec__", None))
    with _children_skip_main_script():
        data = multiprocessing.spawn.get_preparation_data("child")
        assert "init_main_from_path" not in data and "init_main_from_name" not in data
    assert (getattr(main, "__file__", None), getattr(main, "__spec__", None)) == before


@pytest.mark.parametrize("call", ["main()", 'if __name__ == "__main__":\n    main()'], ids=["top-level", "guarded"])
def test_a_users_script_starts_the_engine(model_dir, tmp_path, call):
    """Both failed before: at top level the spawned engine process ran the script again and
    multiprocessing aborted; behind the guard the worker died in vLLM's kernel-override scan on
    llvmlite's `lib` (numba loaded by the script's imports, run again in the child)."""
    script = tmp_path / "app.py"
    script.write_text(textwrap.dedent(SCRIPT).format(home=str(tmp_path / "home"),
                                                      models=str(default_home() / "models"), call=call))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    answer = [line for line in run.stdout.splitlines() if line.startswith("ANSWER")]
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(answer) == 1 and int(answer[0].split()[1]) > 0, run.stdout[-2000:]
