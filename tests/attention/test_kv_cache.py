"""ContiguousKVCache: shapes, filling, overflow and the bytes it reserves."""

from __future__ import annotations

import pytest
import torch

from llm_runtime import ContiguousKVCache


def test_update_returns_everything_written_so_far() -> None:
    cache = ContiguousKVCache(num_layers=2, batch_size=3, max_seq_len=10, num_kv_heads=2, head_dim=4,
                              dtype=torch.float32, device="cpu")
    first = torch.randn(3, 2, 6, 4)
    k, v = cache.update(0, first, -first)
    assert k.shape == (3, 2, 6, 4) and torch.equal(k, first) and torch.equal(v, -first)
    cache.advance(6)
    second = torch.randn(3, 2, 1, 4)
    k, _ = cache.update(0, second, second)
    assert k.shape == (3, 2, 7, 4)
    assert torch.equal(k[:, :, :6], first) and torch.equal(k[:, :, 6:], second)


def test_overflow_is_a_clear_error() -> None:
    cache = ContiguousKVCache(1, 1, 4, 1, 2, dtype=torch.float32, device="cpu")
    cache.advance(3)
    with pytest.raises(ValueError, match="KV cache full"):
        cache.update(0, torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2))


def test_bytes_follow_the_formula(tiny_pairs) -> None:
    model, _ = tiny_pairs["qwen3"]
    config = model.config
    cache = model.new_kv_cache(batch_size=2, max_seq_len=50)
    per_token = config.kv_bytes_per_token(dtype_size=8)
    assert per_token == 2 * config.num_layers * config.num_kv_heads * config.head_dim * 8
    assert cache.nbytes == 2 * 50 * per_token
    cache.advance(10)
    assert cache.nbytes_used == 2 * 10 * per_token
