"""Causal attention over a contiguous key/value history, in plain PyTorch.

Query heads outnumber key/value heads under grouped-query attention; scaled_dot_product_attention
with `enable_gqa` lets each group of query heads read its shared K/V head without copying it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    num_cached: int,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention for T new queries over S = num_cached + T keys.

    q (B, num_heads, T, head_dim) holds positions num_cached .. num_cached + T - 1;
    k, v (B, num_kv_heads, S, head_dim) hold every position from 0. `key_mask` (B, S), when given,
    marks the keys that are real tokens (False for padding). Returns (B, num_heads, T, head_dim).
    """
    num_queries, num_keys = q.shape[2], k.shape[2]
    if num_keys != num_cached + num_queries:
        raise ValueError(f"expected {num_cached} + {num_queries} keys, got {num_keys}")
    if key_mask is None:
        if num_queries == 1:
            # Decode: the one new token may look at everything, itself included.
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        if num_cached == 0:
            # Prefill from an empty cache: the square causal mask.
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    # General case: query i sees keys 0 .. num_cached + i that are real tokens.
    query_positions = torch.arange(num_cached, num_keys, device=q.device)[:, None]  # (T, 1)
    key_positions = torch.arange(num_keys, device=q.device)[None, :]  # (1, S)
    mask = key_positions <= query_positions  # (T, S), True = may attend
    if key_mask is not None:
        # A padding query has no real key to look at; letting it see itself keeps its softmax
        # finite (its output is never used), where an all-masked row would produce NaN.
        mask = (mask & key_mask[:, None, None, :]) | (key_positions == query_positions)  # (B, 1, T, S)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
