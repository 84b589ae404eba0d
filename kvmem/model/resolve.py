"""Resolve what the user asked for (nothing, a folder, a hub id) into a servable HF folder."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvmem.errors import ModelError
from kvmem.model import bundled
from kvmem.model.fingerprint import fingerprint


@dataclass(frozen=True)
class ModelInfo:
    path: Path
    fingerprint: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_size: int

    def kv_bytes_per_token(self, codec: str = "none") -> int:
        """Bytes of one token's K and V in a blob: the engine's own for codec none."""
        import torch

        from kvmem.kv.codec import bytes_per_token

        itemsize = torch.empty(0, dtype=getattr(torch, self.dtype)).element_size()
        return bytes_per_token(codec, self.num_layers, self.num_kv_heads, self.head_size, itemsize)


def resolve_model(model: str | None, models_dir: Path, dtype: str = "bfloat16") -> ModelInfo:
    """None (SmolLM2) or a name in bundled.BUNDLED: that model, converted once; a folder path;
    else a hub id (needs a network). A bundled name wins over a folder of that name: pass ./name."""
    entry = bundled.lookup(model)
    if entry is not None:
        path = bundled.converted(entry, models_dir, dtype)
    elif Path(model).expanduser().is_dir():
        path = Path(model).expanduser().resolve()
    else:
        path = _download(model, models_dir)
    if not (path / "config.json").is_file():
        raise ModelError(f"{path} is not a HF model folder: it has no config.json")
    from transformers import AutoConfig

    # transformers' config maps each family's own names (GPT-J's n_head, n_layer) to the common ones.
    cfg = AutoConfig.from_pretrained(path)
    heads = cfg.num_attention_heads
    return ModelInfo(
        path=path,
        fingerprint=fingerprint(path, dtype),
        dtype=dtype,
        num_layers=cfg.num_hidden_layers,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_size=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
    )


def _download(repo_id: str, models_dir: Path) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, cache_dir=models_dir / "hub"))
    except Exception as e:  # noqa: BLE001 - any hub failure means the same thing to the caller
        raise ModelError(f"{repo_id!r} is neither a local model folder nor downloadable: {e}") from e
