"""Rotating keys between their pre-RoPE form and a serving position.

The engine rotates keys with its rotary embedding's cos/sin table (in the model dtype) before
caching them. We rotate with that very table, upcast to float32, through vLLM's own fused
rotary kernel (or its `forward_static` reference where the kernel is missing; both know partial
rotary and neox/gpt-j styles); un-rotation uses the exact inverse of the same table: for each
2x2 block [c -s; s c] the inverse is [c s; -s c] / (c^2 + s^2), which stays correct when the
table carries a scale (YaRN's mscale).

Moving a cached key from position p to q (`move`) is R(q) R(p)^-1. Each 2x2 block [c -s; s c]
acts as the complex number c + is, so the product is one complex multiply per block: we build
that one row per token (cheap: T x rot_dim / 2) and run the kernel once, over every layer. This
uses the engine's own rows at p and q (bf16 tables included, scaled ones too), so a moved key is
what un-rotating and re-rotating would give, at the cost of one rotation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class KeyRotator:
    def __init__(self, rope: torch.nn.Module, use_kernel: bool = True) -> None:
        table = _table_of(rope).detach().to(torch.float32).cpu()  # [max_pos, rot_dim]
        cos, sin = table.chunk(2, dim=-1)
        norm = cos * cos + sin * sin
        self._forward = table
        self._inverse = torch.cat((cos / norm, -sin / norm), dim=-1)
        self._on_device: dict[tuple[bool, torch.device], torch.Tensor] = {}
        self._forward_static = getattr(type(rope), "forward_static", None)
        self._kernel = rotary_kernel() if use_kernel else None
        if self._kernel is None and self._forward_static is None:
            raise NotImplementedError(f"{type(rope).__name__} needs vLLM's rotary kernel, missing from this build")
        self.head_size = rope.head_size
        self.rotary_dim = rope.rotary_dim
        self.is_neox_style = getattr(rope, "is_neox_style", True)
        self.max_position = table.shape[0]

    def rotate(self, key: torch.Tensor, positions: torch.Tensor, inplace: bool = False) -> torch.Tensor:
        """key [L, T, H, D] pre-RoPE -> float32 [L, T, H, D] rotated to positions [T].

        With inplace=True, key must be a contiguous float32 tensor; it is overwritten and returned
        (saves a copy of the whole batch on the injection path).
        """
        return self._apply(key, positions, inverse=False, inplace=inplace)

    def unrotate(self, key: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """key [L, T, H, D] as cached at positions [T] -> float32 [L, T, H, D] pre-RoPE."""
        return self._apply(key, positions, inverse=True, inplace=False)

    def _apply(self, key: torch.Tensor, positions: torch.Tensor, inverse: bool = False, inplace: bool = False,
               table: torch.Tensor | None = None) -> torch.Tensor:
        layers, tokens, heads, dim = key.shape
        if dim != self.head_size:
            raise ValueError(f"head size {dim}, rotary embedding expects {self.head_size}")
        if positions.device.type == "cpu" and table is None:  # on a GPU this would sync; callers check first
            self.check_positions(positions)
        if inplace and (key.dtype != torch.float32 or not key.is_contiguous()):
            raise ValueError("in-place rotation needs a contiguous float32 key")
        table = self._table(inverse, key.device) if table is None else table
        positions = positions.to(key.device, torch.long)
        if self._kernel is None:
            rotated = self._static(key, positions, table)
            return key.copy_(rotated) if inplace else rotated
        out = key if inplace else torch.empty(key.shape, dtype=torch.float32, device=key.device).copy_(key)
        # Layers act as extra tokens: [L*T, H*D] with the positions repeated per layer, one call.
        flat_positions = positions if layers == 1 else positions.repeat(layers)
        self._kernel(flat_positions, out.view(layers * tokens, heads * dim), None, self.head_size, table,
                     self.is_neox_style)
        return out

    def move(self, key: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        """key [L, T, H, D] contiguous float32, rotated to positions src [T] (-1: not rotated,
        a pre-RoPE key) -> rotated to positions dst [T], in place. Host or device positions."""
        return self.apply_rows(key, self.move_rows(src, dst, key.device))

    def move_rows(self, src: torch.Tensor, dst: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The rows [T, rot_dim] of R(dst) R(src)^-1 per token, on `device`: what `apply_rows`
        needs to move keys cached at src [T] (-1: pre-RoPE) to dst [T]. Layers share them."""
        src = src.to(device, torch.long)
        dst = dst.to(device, torch.long)
        fwd_cos, fwd_sin = self._table(False, device)[dst].chunk(2, dim=-1)  # [T, rot/2] each
        inv_cos, inv_sin = self._table(True, device)[src.clamp_min(0)].chunk(2, dim=-1)
        unrotated = (src < 0)[:, None]
        inv_cos = inv_cos.masked_fill(unrotated, 1.0)  # a pre-RoPE key: R(p)^-1 is the identity
        inv_sin = inv_sin.masked_fill(unrotated, 0.0)
        return torch.cat((fwd_cos * inv_cos - fwd_sin * inv_sin, fwd_cos * inv_sin + fwd_sin * inv_cos), dim=-1)

    def apply_rows(self, key: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """key [L, T, H, D] contiguous float32, token t rotated by rows[t] (move_rows), in place."""
        return self._apply(key, torch.arange(len(rows), device=key.device), table=rows, inplace=True)

    def check_positions(self, positions: torch.Tensor) -> None:
        """positions [T] on the host: ValueError if any lies beyond the rotary table."""
        if positions.numel() and int(positions.max()) >= self.max_position:
            raise ValueError(f"position {int(positions.max())} beyond the rotary table ({self.max_position})")

    def _static(self, key: torch.Tensor, positions: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """vLLM's reference implementation, for builds without the rotary kernel."""
        layers, tokens, heads, dim = key.shape
        # Layers act as extra heads: [T, L*H*D].
        flat = key.to(torch.float32).permute(1, 0, 2, 3).reshape(tokens, layers * heads * dim)
        rotated, _ = self._forward_static(positions, flat, None, self.head_size, self.rotary_dim, table,
                                          self.is_neox_style)
        return rotated.reshape(tokens, layers, heads, dim).permute(1, 0, 2, 3)

    def _table(self, inverse: bool, device: torch.device) -> torch.Tensor:
        cached = self._on_device.get((inverse, device))
        if cached is None:
            cached = self._on_device[(inverse, device)] = (self._inverse if inverse else self._forward).to(device)
        return cached


def is_rotary(module: torch.nn.Module) -> bool:
    """Whether `module` is one of vLLM's rotary embeddings (with a cos/sin table we can read)."""
    has_table = hasattr(module, "cos_sin_cache") or hasattr(module, "long_short_cos_sin_cache")
    return has_table and hasattr(module, "head_size") and hasattr(module, "rotary_dim")


def _table_of(rope: torch.nn.Module) -> torch.Tensor:
    """The cos/sin table [max_pos, rot_dim] the engine rotates keys with."""
    if hasattr(rope, "cos_sin_cache"):
        return rope.cos_sin_cache
    if hasattr(rope, "long_short_cos_sin_cache"):
        # Phi-3 LongRoPE: the short table, then the long one. vLLM picks one for every position
        # at start-up (long when max_model_len exceeds the original context), so ours is that one.
        split = rope.original_max_position_embeddings
        both = rope.long_short_cos_sin_cache
        return both[split:] if rope.use_long_rope else both[:split]
    raise NotImplementedError(f"kvmem cannot read the table of {type(rope).__name__}")


class LayerRotators:
    """One KeyRotator per attention layer, in cache order: models such as Gemma 3 give local and
    global layers different rotary bases. Layers that share a rotary embedding share one rotator,
    and a batch of layers is rotated in one call per distinct embedding."""

    def __init__(self, per_layer: Sequence[KeyRotator]) -> None:
        if not per_layer:
            raise ValueError("no layers to rotate")
        self.per_layer = list(per_layer)
        groups: dict[int, list[int]] = {}
        for i, rot in enumerate(self.per_layer):
            groups.setdefault(id(rot), []).append(i)
        self._groups = [(self.per_layer[idx[0]], torch.tensor(idx)) for idx in groups.values()]
        self.max_position = min(r.max_position for r in self.per_layer)

    @classmethod
    def uniform(cls, rotator: KeyRotator, num_layers: int) -> LayerRotators:
        return cls([rotator] * num_layers)

    def __len__(self) -> int:
        return len(self.per_layer)

    def rotate(self, key: torch.Tensor, positions: torch.Tensor, inplace: bool = False) -> torch.Tensor:
        """key [L, T, H, D] pre-RoPE, L = all layers -> float32 [L, T, H, D] at positions [T]."""
        return self._apply(key, positions, inverse=False, inplace=inplace)

    def unrotate(self, key: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """key [L, T, H, D] as cached at positions [T] -> float32 [L, T, H, D] pre-RoPE."""
        return self._apply(key, positions, inverse=True, inplace=False)

    def rotate_layer(self, layer: int, key: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """key [1, T, H, D] contiguous float32 of one layer, rotated in place."""
        return self.per_layer[layer].rotate(key, positions, inplace=True)

    def check_positions(self, positions: torch.Tensor) -> None:
        for rot, _ in self._groups:
            rot.check_positions(positions)

    def _apply(self, key: torch.Tensor, positions: torch.Tensor, inverse: bool, inplace: bool) -> torch.Tensor:
        if key.shape[0] != len(self.per_layer):
            raise ValueError(f"{key.shape[0]} layers of keys, {len(self.per_layer)} rotators")
        if len(self._groups) == 1:
            return self.per_layer[0]._apply(key, positions, inverse, inplace)
        if inplace and (key.dtype != torch.float32 or not key.is_contiguous()):
            raise ValueError("in-place rotation needs a contiguous float32 key")
        out = key if inplace else torch.empty(key.shape, dtype=torch.float32, device=key.device)
        for rot, idx in self._groups:
            idx = idx.to(key.device)
            out[idx] = rot._apply(key[idx], positions, inverse, inplace=False)  # [l, T, H, D] per group
        return out


def rotary_kernel():
    """vLLM's fused in-place rotary kernel (CPU and CUDA builds), ~50x faster than the torch ops."""
    try:
        from vllm import _custom_ops as ops

        return ops.rotary_embedding
    except (ImportError, AttributeError):
        return None
