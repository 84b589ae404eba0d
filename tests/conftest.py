"""One real engine per test session: vLLM on the bundled SmolLM2, CPU, our connector."""

from __future__ import annotations

import logging

import pytest

from kvmem.config import Config, default_home


@pytest.fixture(scope="session")
def model_dir():
    """The bundled SmolLM2 as a HF folder (converted on first use into the shared model cache)."""
    from kvmem.model import resolve_model

    return resolve_model(None, default_home() / "models").path


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="session")
def mem(model_dir, tmp_path_factory):
    from kvmem.service import KVMem

    # Models are converted once into the shared cache; KV blobs go to a fresh folder.
    config = Config(home=tmp_path_factory.mktemp("kvmem-home"), models_home=default_home() / "models")
    logging.getLogger("kvmem").setLevel(logging.INFO)
    client = KVMem(config)
    # Warm-up: the first requests of a fresh engine pay one-off costs that would skew timings.
    f = client.add_fact("warmup", "The warm-up user likes tea.")
    client.encode([f.id])
    client.chat("warmup", "What do I like?", [f.id], mode="text", max_tokens=2)
    client.chat("warmup", "What do I like?", [f.id], mode="kv", max_tokens=2)
    yield client
    client.close()
