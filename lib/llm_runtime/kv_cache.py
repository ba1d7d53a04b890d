"""The KV cache: keys and values of every past token, kept so each decode step computes one token.

`ContiguousKVCache` is the simplest layout: one preallocated tensor per layer, filled left to right.
Later lessons add a paged cache behind the same two calls, `update` and `advance`.
"""

from __future__ import annotations

import torch

from .config import ModelConfig


class ContiguousKVCache:
    """Per layer, K and V of shape (batch, num_kv_heads, max_seq_len, head_dim).

    Invariant: positions [0, num_tokens) of every row hold real keys and values; the rest is unused.
    A forward pass writes its T new tokens into every layer with `update`, then calls `advance(T)` once.
    """

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        max_seq_len: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if min(num_layers, batch_size, max_seq_len, num_kv_heads, head_dim) < 1:
            raise ValueError("every KV cache dimension must be >= 1")
        shape = (batch_size, num_kv_heads, max_seq_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_seq_len = max_seq_len
        self.num_tokens = 0

    @classmethod
    def for_model(
        cls,
        config: ModelConfig,
        batch_size: int,
        max_seq_len: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> "ContiguousKVCache":
        """A cache shaped for `config`, reserving `max_seq_len` positions per row."""
        return cls(config.num_layers, batch_size, max_seq_len, config.num_kv_heads, config.head_dim,
                   dtype=dtype, device=device)

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's k, v (B, num_kv_heads, T, head_dim); return all of them so far (B, kv, S, d)."""
        start, end = self.num_tokens, self.num_tokens + k.shape[2]
        if end > self.max_seq_len:
            raise ValueError(f"KV cache full: {end} tokens do not fit in max_seq_len={self.max_seq_len}")
        self.keys[layer_idx][:, :, start:end] = k
        self.values[layer_idx][:, :, start:end] = v
        return self.keys[layer_idx][:, :, :end], self.values[layer_idx][:, :, :end]

    def advance(self, num_new_tokens: int) -> None:
        """Mark `num_new_tokens` more positions as filled (after every layer has written them)."""
        self.num_tokens += num_new_tokens

    @property
    def nbytes(self) -> int:
        """Bytes reserved, used or not."""
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    @property
    def nbytes_used(self) -> int:
        """Bytes that hold real tokens."""
        return self.nbytes * self.num_tokens // self.max_seq_len
