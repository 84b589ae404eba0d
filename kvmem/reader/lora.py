"""A low-rank adapter on the reader's projections, saved in PEFT's layout so vLLM loads it.

By default only the query projections (`TARGET`). Whatever it adapts, it runs on the tokens a
KV-mode chat computes (the tail and the reply): the facts' keys and values stay what the encoder
stored without it, which is what lets one set of blobs serve chats with and without it.

Files in an adapter folder: adapter_config.json and adapter_model.safetensors (PEFT's names,
what vLLM's LoRA loader reads), kvmem.json (the model fingerprint it was trained for, and
how it was trained), and kv_map.safetensors (reader/kvmap.py: applied by kvmem's connector at
injection, not by vLLM). An adapter has a LoRA, a KV map, or both; without a LoRA its folder has
no PEFT files and vLLM runs no LoRA for it.
"""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from kvmem.errors import AdapterError
from kvmem.reader.targets import TARGETS  # torch-free, for the command table

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


def attach(model, rank: int = 8, alpha: float = 16.0,
           targets: tuple[str, ...] = (TARGET,)) -> list[tuple[str, LoRALinear]]:
    """Wrap every layer's linear layers named in `targets` (q_proj, o_proj, down_proj...); freezes
    the base model. Returns (PEFT module name, wrapper)."""
    unknown = set(targets) - set(TARGETS)
    if not targets or unknown:
        raise AdapterError(f"targets must be among {TARGETS}, got {tuple(targets)}")
    for p in model.parameters():
        p.requires_grad_(False)
    wrapped = []
    for name, module in list(model.named_modules()):
        parent_name, _, leaf = name.rpartition(".")
        if leaf in targets and parent_name.rpartition(".")[2] in ("self_attn", "mlp") and isinstance(module, nn.Linear):
            lora = LoRALinear(module, rank, alpha)
            setattr(model.get_submodule(parent_name), leaf, lora)
            wrapped.append((name, lora))
    if not wrapped:
        raise AdapterError(f"{type(model).__name__} has no {'/'.join(targets)} linear layers to adapt")
    return wrapped


def targets_of(wrapped) -> list[str]:
    """The module kinds an attached adapter wraps, in TARGETS order (PEFT's target_modules)."""
    leaves = {name.rpartition(".")[2] for name, _ in wrapped}
    return [t for t in TARGETS if t in leaves]


def folder_targets(folder: Path) -> list[str]:
    """An adapter folder's target_modules, as vLLM must be told them (--lora-target-modules);
    AdapterError when they are missing or not among TARGETS (vLLM would wrap lm_head or fail)."""
    path = Path(folder) / "adapter_config.json"
    try:
        targets = json.loads(path.read_text()).get("target_modules")
    except (OSError, ValueError, AttributeError) as e:
        raise AdapterError(f"{path} is unreadable: {e}") from e
    if not isinstance(targets, list) or not targets or not set(targets) <= set(TARGETS):
        raise AdapterError(f"{path}: target_modules must be a list among {TARGETS}, got {targets!r}")
    return targets


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


def save(wrapped, folder: Path, *, rank: int, alpha: float, base_model: str, meta: dict, kv_map=None) -> None:
    """PEFT layout for the LoRA in `wrapped` (none when it is empty) and the KV map when given
    (reader/kvmap.py); written to a temporary folder and renamed, so a crash leaves no half adapter."""
    from kvmem.reader import kvmap

    folder = Path(folder)
    if not wrapped and kv_map is None:
        raise AdapterError("an adapter needs a LoRA, a KV map or both")
    tmp = folder.with_name(folder.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    for stale in tmp.iterdir():  # left by an earlier crash
        stale.unlink()
    (tmp / META).write_text(json.dumps(meta, indent=1))
    if kv_map is not None:
        kvmap.save(tmp, kv_map)
    if wrapped:
        _save_peft(wrapped, tmp, rank, alpha, base_model)
    if folder.exists():
        old = folder.with_name(folder.name + ".old")
        folder.rename(old)
        tmp.rename(folder)
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
    else:
        tmp.rename(folder)


def _save_peft(wrapped, tmp: Path, rank: int, alpha: float, base_model: str) -> None:
    from safetensors.torch import save_file

    tensors = {}
    for name, m in wrapped:
        tensors[f"base_model.model.{name}.lora_A.weight"] = m.lora_A.detach().contiguous().clone()
        tensors[f"base_model.model.{name}.lora_B.weight"] = m.lora_B.detach().contiguous().clone()
    save_file(tensors, str(tmp / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
              "target_modules": targets_of(wrapped), "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
              "base_model_name_or_path": base_model, "modules_to_save": None, "use_rslora": False,
              "use_dora": False}
    (tmp / "adapter_config.json").write_text(json.dumps(config, indent=1))


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


PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors")


def has_lora(folder: Path) -> bool:
    """Whether an adapter folder holds a LoRA (PEFT files), which vLLM must then run."""
    return any((Path(folder) / name).exists() for name in PEFT_FILES)


def read_meta(folder: Path) -> dict:
    """kvmem.json of an adapter folder; AdapterError when it is not a complete adapter (no
    kvmem.json, half a LoRA, or neither a LoRA nor a KV map)."""
    from kvmem.reader.kvmap import FILE as KV_MAP

    folder = Path(folder)
    needed = (META, *PEFT_FILES) if has_lora(folder) or not (folder / KV_MAP).is_file() else (META,)
    for name in needed:
        if not (folder / name).is_file():
            raise AdapterError(f"{folder} is not a reader adapter: {name} is missing")
    try:
        return json.loads((folder / META).read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"{folder / META} is unreadable: {e}") from e
