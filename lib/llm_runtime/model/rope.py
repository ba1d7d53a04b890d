"""Rotary position embeddings (RoPE), with linear and Llama-3 frequency scaling.

The angles are computed in float32 whatever the model's dtype, as the reference implementation
does; a float64 model then agrees with transformers to rounding, not to float32's 1e-7.
"""

from __future__ import annotations

import math

import torch

from ..config import RopeConfig
from .pointwise import rotary


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """theta^(-2i/d) for i < d/2, scaled by the config's rule. Shape (head_dim // 2,), float32."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        # Long wavelengths (low frequencies) are stretched by `factor`, short ones kept,
        # and the band between is interpolated smoothly.
        old_len = rope.original_max_position_embeddings
        low_freq_wavelen = old_len / rope.low_freq_factor
        high_freq_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(torch.nn.Module):
    """Turns positions into (cos, sin) tables and rotates query/key heads by them."""

    def __init__(self, rope: RopeConfig, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.register_buffer("inv_freq", inverse_frequencies(rope, head_dim), persistent=False)

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
