"""all-MiniLM-L6-v2 in NumPy, for processes that embed a query or two and must start fast.

`kvmem search` embeds one query; loading torch and transformers for it costs ~2 s of a cold
process, more than the search. This is the same BERT forward (embeddings -> 6 encoder layers ->
mean pooling over real tokens -> L2 norm) on the same files, read with `safetensors.numpy` and
the `tokenizers` library, in ~0.2 s. It is exact to float32 rounding against MiniLMEmbedder
(tests/embed/test_numpy_minilm.py), so the vectors it makes search the same stored vectors.
Batches of facts still go through MiniLMEmbedder: torch is faster once loaded.
"""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path

import numpy as np

from kvmem.embed.base import DEFAULT_BATCH_SIZE, Embedder
from kvmem.embed.minilm import MAX_TOKENS, MiniLMEmbedder, bundled_model_dir
from kvmem.errors import ModelError

_erf = np.frompyfunc(math.erf, 1, 1)  # exact GELU, as BERT's "gelu" is; NumPy has no erf


class NumpyMiniLMEmbedder(Embedder):
    name = MiniLMEmbedder.name
    dim = MiniLMEmbedder.dim

    def __init__(self, batch_size: int = DEFAULT_BATCH_SIZE, model_dir: Path | None = None) -> None:
        super().__init__(batch_size)
        self._model_dir = model_dir
        self._w: dict[str, np.ndarray] | None = None
        self._lock = threading.Lock()

    def _load(self) -> None:
        if self._w is not None:
            return
        path = self._model_dir or bundled_model_dir()
        try:
            from safetensors.numpy import load_file
            from tokenizers import Tokenizer

            config = json.loads((path / "config.json").read_text())
            tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
            weights = load_file(str(path / "model.safetensors"))
        except Exception as exc:
            raise ModelError(f"could not load {self.name} from {path}: {exc}") from exc
        tokenizer.enable_truncation(MAX_TOKENS)
        tokenizer.enable_padding(pad_id=config.get("pad_token_id", 0))
        self._heads, self._layers = config["num_attention_heads"], config["num_hidden_layers"]
        self._eps = config["layer_norm_eps"]
        self._tokenizer, self._w = tokenizer, {k.removeprefix("bert."): v for k, v in weights.items()}

    def _embed_batch(self, texts: list[str]) -> np.ndarray:
        with self._lock:
            self._load()
            enc = self._tokenizer.encode_batch(texts)
            ids = np.array([e.ids for e in enc])  # [b, t]
            mask = np.array([e.attention_mask for e in enc], dtype=np.float32)  # [b, t]
            types = np.array([e.type_ids for e in enc])  # [b, t]
            h = self._embeddings(ids, types)  # [b, t, d]
            for i in range(self._layers):
                h = self._layer(h, mask, f"encoder.layer.{i}.")
            return (h * mask[..., None]).sum(1) / np.maximum(mask.sum(1, keepdims=True), 1e-9)  # [b, d]

    def _embeddings(self, ids: np.ndarray, types: np.ndarray) -> np.ndarray:
        w = self._w
        positions = np.arange(ids.shape[1])
        h = (w["embeddings.word_embeddings.weight"][ids] + w["embeddings.position_embeddings.weight"][positions]
             + w["embeddings.token_type_embeddings.weight"][types])  # [b, t, d]
        return self._norm(h, "embeddings.LayerNorm.")

    def _layer(self, h: np.ndarray, mask: np.ndarray, p: str) -> np.ndarray:
        b, t, d = h.shape
        n, hd = self._heads, d // self._heads

        def heads(name: str) -> np.ndarray:  # [b, t, d] -> [b, n, t, hd]
            return self._linear(h, p + f"attention.self.{name}.").reshape(b, t, n, hd).transpose(0, 2, 1, 3)

        scores = heads("query") @ heads("key").transpose(0, 1, 3, 2) / math.sqrt(hd)  # [b, n, t, t]
        scores = scores + (1.0 - mask[:, None, None, :]) * np.finfo(np.float32).min  # padding never attended
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        attn = (scores / scores.sum(-1, keepdims=True)) @ heads("value")  # [b, n, t, hd]
        attn = attn.transpose(0, 2, 1, 3).reshape(b, t, d)
        h = self._norm(h + self._linear(attn, p + "attention.output.dense."), p + "attention.output.LayerNorm.")
        x = self._linear(h, p + "intermediate.dense.")  # [b, t, 4d]
        x = (0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)).astype(np.float32))).astype(np.float32)
        return self._norm(h + self._linear(x, p + "output.dense."), p + "output.LayerNorm.")

    def _linear(self, x: np.ndarray, p: str) -> np.ndarray:
        return x @ self._w[p + "weight"].T + self._w[p + "bias"]

    def _norm(self, x: np.ndarray, p: str) -> np.ndarray:
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return (x - mean) / np.sqrt(var + self._eps) * self._w[p + "weight"] + self._w[p + "bias"]
