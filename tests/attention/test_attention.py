"""causal_attention: each of its three cases equals explicit softmax(QK^T)V with a causal mask."""

from __future__ import annotations

import pytest
import torch

from llm_runtime.attention import causal_attention


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_cached: int) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (B, H, S, d)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5  # (B, H, T, S)
    query_pos = torch.arange(num_cached, num_cached + q.shape[2])[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[2])[None, :] > query_pos, float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("num_cached,num_new", [(0, 7), (9, 1), (5, 4)], ids=["prefill", "decode", "chunk"])
def test_matches_naive_attention(num_cached: int, num_new: int) -> None:
    torch.manual_seed(0)
    q = torch.randn(2, 6, num_new, 8, dtype=torch.float64)
    k = torch.randn(2, 2, num_cached + num_new, 8, dtype=torch.float64)
    v = torch.randn_like(k)
    out = causal_attention(q, k, v, num_cached)
    assert (out - naive_attention(q, k, v, num_cached)).abs().max() < 1e-12


def test_wrong_key_count_is_an_error() -> None:
    with pytest.raises(ValueError, match="keys"):
        causal_attention(torch.zeros(1, 2, 3, 4), torch.zeros(1, 1, 5, 4), torch.zeros(1, 1, 5, 4), num_cached=1)
