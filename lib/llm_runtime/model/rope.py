"""Rotary position embeddings (RoPE), with linear and Llama-3 frequency scaling (the frequencies:
`RopeConfig.inverse_frequencies`, config.py).

The angles are computed in float32 whatever the model's dtype, as the reference implementation
does; a float64 model then agrees with transformers to rounding, not to float32's 1e-7.
"""

from __future__ import annotations

import torch

from ..config import RopeConfig
from .pointwise import rotary


class RotaryEmbedding(torch.nn.Module):
    """Turns positions into (cos, sin) tables and rotates query/key heads by them."""

    def __init__(self, rope: RopeConfig, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.register_buffer("inv_freq", rope.inverse_frequencies(head_dim), persistent=False)

    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def]
        """`model.to(...)` moves the frequencies but keeps them in float32: `model.to(torch.bfloat16)` then
        gives the same model as loading it in bfloat16 (rounded frequencies would shift every angle)."""
        inv_freq = self.inv_freq
        super()._apply(fn, recurse)
        self.inv_freq = inv_freq.to(device=self.inv_freq.device)
        return self

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (B, T) -> cos, sin, each (B, T, head_dim) in `dtype`."""
        freqs = positions[..., None].float() * self.inv_freq.float()  # (B, T, head_dim/2)
        angles = torch.cat((freqs, freqs), dim=-1)  # (B, T, head_dim)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x_i, x_{i+d/2}) by each position's angle. x (B, heads, T, d); cos, sin (B, T, d)."""
    return rotary(x, cos, sin)
