"""The bundled model in PyTorch (transformers), fp32, and small chats tokenized as kvmem serves them."""

from __future__ import annotations

import pytest
import torch

from kvmem.reader.examples import from_records

FACTS = ["My sister adopted a puppy named Bruno.", "I live in Lisbon near the river.",
         "I play the cello every Sunday morning.", "My favourite food is grilled sardines."]


class _Record:
    """The two fields a chat reads from a fact record."""

    def __init__(self, i: int, text: str, context: str = "") -> None:
        self.id, self.text, self.context = f"f-{i}", text, context


@pytest.fixture(scope="session")
def hf_model(model_dir):
    from kvmem.reader.train import load_model

    torch.manual_seed(0)
    return load_model(model_dir)


@pytest.fixture(scope="session")
def prompts(tokenizer):
    from kvmem.engine.prompt import PromptBuilder

    return PromptBuilder(tokenizer)


@pytest.fixture(scope="session")
def make_example(prompts):
    def make(facts=FACTS, question="What is my sister's puppy called?", contexts=None):
        contexts = contexts or [""] * len(facts)
        records = [_Record(i, t, c) for i, (t, c) in enumerate(zip(facts, contexts))]
        return from_records(prompts, records, [{"role": "user", "content": question}])

    return make


@pytest.fixture(scope="session")
def eos(tokenizer):
    from kvmem.reader.train import eos_ids

    return eos_ids(tokenizer)
