"""A low-rank adapter on the attention query projections, saved in PEFT's layout so vLLM loads it.

Only the queries change: keys and values of every token the adapter does not read stay what
the encoder stored, which is what lets one set of blobs serve chats with and without it.

Files in an adapter folder: adapter_config.json and adapter_model.safetensors (PEFT's names,
what vLLM's LoRA loader reads), and kvmem.json (the model fingerprint it was trained for, and
how it was trained).
"""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from kvmem.errors import AdapterError

TARGET = "q_proj"
META = "kvmem.json"


class LoRALinear(nn.Module):
    """base(x) + scale * B(A(x)); B starts at zero, so a new adapter changes nothing."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        self.base = base
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features))  # [r, in]
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank))  # [out, r]
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # PEFT's default init for A
        self.scale = alpha / rank
        self.enabled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        if not self.enabled:
            return out
        return out + (x @ self.lora_A.T @ self.lora_B.T) * self.scale  # [..., in] -> [..., out]


def attach(model, rank: int = 8, alpha: float = 16.0) -> list[tuple[str, LoRALinear]]:
    """Wrap every layer's q_proj; freezes the base model. Returns (PEFT module name, wrapper)."""
    for p in model.parameters():
        p.requires_grad_(False)
    wrapped = []
    for name, module in list(model.named_modules()):
        if name.endswith(f"self_attn.{TARGET}") and isinstance(module, nn.Linear):
            parent = model.get_submodule(name.rsplit(".", 1)[0])
            lora = LoRALinear(module, rank, alpha)
            setattr(parent, TARGET, lora)
            wrapped.append((name, lora))
    if not wrapped:
        raise AdapterError(f"{type(model).__name__} has no self_attn.{TARGET} linear layers to adapt")
    return wrapped


@contextmanager
def disabled(wrapped: list[tuple[str, LoRALinear]]):
    """The base model, for the teacher and for encoding facts (the engine encodes without it)."""
    for _, m in wrapped:
        m.enabled = False
    try:
        yield
    finally:
        for _, m in wrapped:
            m.enabled = True


def save(wrapped, folder: Path, *, rank: int, alpha: float, base_model: str, meta: dict) -> None:
    """PEFT layout; written to a temporary folder and renamed, so a crash leaves no half adapter."""
    from safetensors.torch import save_file

    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, m in wrapped:
        tensors[f"base_model.model.{name}.lora_A.weight"] = m.lora_A.detach().contiguous().clone()
        tensors[f"base_model.model.{name}.lora_B.weight"] = m.lora_B.detach().contiguous().clone()
    save_file(tensors, str(tmp / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
              "target_modules": [TARGET], "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
              "base_model_name_or_path": base_model, "modules_to_save": None, "use_rslora": False,
              "use_dora": False}
    (tmp / "adapter_config.json").write_text(json.dumps(config, indent=1))
    (tmp / META).write_text(json.dumps(meta, indent=1))
    if folder.exists():
        old = folder.with_name(folder.name + ".old")
        folder.rename(old)
        tmp.rename(folder)
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
    else:
        tmp.rename(folder)


def load_into(wrapped, folder: Path) -> None:
    from safetensors.torch import load_file

    tensors = load_file(str(Path(folder) / "adapter_model.safetensors"))
    with torch.no_grad():
        for name, m in wrapped:
            m.lora_A.copy_(tensors[f"base_model.model.{name}.lora_A.weight"])
            m.lora_B.copy_(tensors[f"base_model.model.{name}.lora_B.weight"])


def lora_rank(folder: Path) -> int:
    """The adapter's rank, rounded up to one vLLM allocates for (its max_lora_rank choices)."""
    r = int(json.loads((Path(folder) / "adapter_config.json").read_text())["r"])
    return next(v for v in (8, 16, 32, 64, 128, 256, 320, 512) if v >= r)


def read_meta(folder: Path) -> dict:
    """kvmem.json of an adapter folder; AdapterError when it is not a complete adapter."""
    folder = Path(folder)
    for name in ("adapter_config.json", "adapter_model.safetensors", META):
        if not (folder / name).is_file():
            raise AdapterError(f"{folder} is not a reader adapter: {name} is missing")
    try:
        return json.loads((folder / META).read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"{folder / META} is unreadable: {e}") from e
