"""Rotating keys between their pre-RoPE form and a serving position.

The engine rotates keys with its rotary embedding's cos/sin table (in the model dtype) before
caching them. We rotate with that very table, upcast to float32, through vLLM's own fused
rotary kernel (or its `forward_static` reference where the kernel is missing; both know partial
rotary and neox/gpt-j styles); un-rotation uses the exact inverse of the same table: for each
2x2 block [c -s; s c] the inverse is [c s; -s c] / (c^2 + s^2), which stays correct when the
table carries a scale (YaRN's mscale).
"""

from __future__ import annotations

import torch


class KeyRotator:
    def __init__(self, rope: torch.nn.Module, use_kernel: bool = True) -> None:
        table = rope.cos_sin_cache.detach().to(torch.float32).cpu()  # [max_pos, rot_dim]
        cos, sin = table.chunk(2, dim=-1)
        norm = cos * cos + sin * sin
        self._forward = table
        self._inverse = torch.cat((cos / norm, -sin / norm), dim=-1)
        self._on_device: dict[tuple[bool, torch.device], torch.Tensor] = {}
        self._forward_static = type(rope).forward_static
        self._kernel = _rotary_kernel() if use_kernel else None
        self.head_size = rope.head_size
        self.rotary_dim = rope.rotary_dim
        self.is_neox_style = rope.is_neox_style
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

    def _apply(self, key: torch.Tensor, positions: torch.Tensor, inverse: bool, inplace: bool) -> torch.Tensor:
        layers, tokens, heads, dim = key.shape
        if dim != self.head_size:
            raise ValueError(f"head size {dim}, rotary embedding expects {self.head_size}")
        if positions.device.type == "cpu":  # on a GPU this would sync; callers check host positions first
            self.check_positions(positions)
        if inplace and (key.dtype != torch.float32 or not key.is_contiguous()):
            raise ValueError("in-place rotation needs a contiguous float32 key")
        table = self._table(inverse, key.device)
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


def _rotary_kernel():
    """vLLM's fused in-place rotary kernel (CPU and CUDA builds), ~50x faster than the torch ops."""
    try:
        from vllm import _custom_ops as ops

        return ops.rotary_embedding
    except (ImportError, AttributeError):
        return None
