"""Rotating keys between their pre-RoPE form and a serving position.

The engine rotates keys with its rotary embedding's cos/sin table (in the model dtype) before
caching them. We rotate with that very table through vLLM's own `forward_static` (which knows
partial rotary and neox/gpt-j styles), upcast to float32; un-rotation uses the exact inverse of
the same table: for each 2x2 block [c -s; s c] the inverse is [c s; -s c] / (c^2 + s^2), which
stays correct when the table carries a scale (YaRN's mscale).
"""

from __future__ import annotations

import torch


class KeyRotator:
    def __init__(self, rope: torch.nn.Module) -> None:
        table = rope.cos_sin_cache.detach().to(torch.float32).cpu()  # [max_pos, rot_dim]
        cos, sin = table.chunk(2, dim=-1)
        norm = cos * cos + sin * sin
        self._forward = table
        self._inverse = torch.cat((cos / norm, -sin / norm), dim=-1)
        self._forward_static = type(rope).forward_static
        self.head_size = rope.head_size
        self.rotary_dim = rope.rotary_dim
        self.is_neox_style = rope.is_neox_style
        self.max_position = table.shape[0]

    def rotate(self, key: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """key [L, T, H, D] pre-RoPE -> float32 [L, T, H, D] rotated to positions [T]."""
        return self._apply(key, positions, self._forward)

    def unrotate(self, key: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """key [L, T, H, D] as cached at positions [T] -> float32 [L, T, H, D] pre-RoPE."""
        return self._apply(key, positions, self._inverse)

    def _apply(self, key: torch.Tensor, positions: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        layers, tokens, heads, dim = key.shape
        if dim != self.head_size:
            raise ValueError(f"head size {dim}, rotary embedding expects {self.head_size}")
        if tokens and int(positions.max()) >= self.max_position:
            raise ValueError(f"position {int(positions.max())} beyond the rotary table ({self.max_position})")
        # Layers act as extra heads: [T, L*H*D], one call for the whole blob.
        flat = key.to(torch.float32).permute(1, 0, 2, 3).reshape(tokens, layers * heads * dim)
        rotated, _ = self._forward_static(
            positions.to(torch.long), flat, None, self.head_size, self.rotary_dim,
            table.to(key.device), self.is_neox_style,
        )
        return rotated.reshape(tokens, layers, heads, dim).permute(1, 0, 2, 3)
