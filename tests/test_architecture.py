"""The house's shape, checked: the layer order of pyproject.toml's import contracts (nothing
imports upward), and rooms and functions that fit on a screen."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvmem"
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 60


def lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    """import-linter over the kvmem found first on the path from `cwd`, with `cwd`'s contracts."""
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    code = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True))"
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def test_nothing_imports_upward():
    run = lint_imports(ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 broken" in run.stdout


def test_a_planted_upward_import_breaks_the_contract(tmp_path):
    """The contract is not vacuous: a core room importing the facade fails it, and says where."""
    shutil.copytree(PACKAGE, tmp_path / "kvmem", ignore=shutil.ignore_patterns("__pycache__", "shipped"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    codec = tmp_path / "kvmem" / "kv" / "codec.py"
    codec.write_text(codec.read_text() + "\n\ndef _planted():\n    from kvmem.service import KVMem  # noqa\n")
    run = lint_imports(tmp_path)
    assert run.returncode != 0, run.stdout
    assert "BROKEN" in run.stdout and "kvmem.kv.codec -> kvmem.service" in run.stdout, run.stdout


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_no_module_is_over_450_lines():
    long = {str(p.relative_to(ROOT)): n for p in _modules() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def _is_argparse_table(source: list[str]) -> bool:
    """A function that is mostly argparse declarations (add_argument / add_parser lines)."""
    declaring = sum(("add_argument" in line or "add_parser" in line or "set_defaults" in line) for line in source)
    return declaring * 3 >= len(source)


def _long_functions(path: Path, root: Path = ROOT) -> list[str]:
    lines = path.read_text().splitlines()
    long = []
    for node in ast.walk(ast.parse("\n".join(lines))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            size = node.end_lineno - node.lineno + 1
            if size > MAX_FUNCTION_LINES and not _is_argparse_table(lines[node.lineno - 1: node.end_lineno]):
                long.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({size} lines)")
    return long


def test_no_function_is_over_60_lines_except_argparse_tables():
    long = [f for p in _modules() for f in _long_functions(p)]
    assert not long, "functions over 60 lines:\n" + "\n".join(long)


@pytest.mark.parametrize("size, expected", [(MAX_FUNCTION_LINES, False), (MAX_FUNCTION_LINES + 1, True)])
def test_the_function_check_counts_lines_as_written(tmp_path, size, expected):
    body = "\n".join(f"    x{i} = {i}" for i in range(size - 2))
    path = tmp_path / "probe.py"
    path.write_text(f"def f():\n{body}\n    return 0\n")
    assert bool(_long_functions(path, tmp_path)) is expected
