"""Lesson 01 exercises: the pieces of one decoder layer, checked against the package's model code.

- `rms_norm(x, weight, eps)`: RMSNorm, against `model.layers.RMSNorm`.
- `kv_bytes_per_token(config, dtype_size)`: the KV cache's bytes per token, against
  `ModelConfig.kv_bytes_per_token`.
- `gqa_attention(q, k, v, num_cached)`: causal grouped-query attention of T new queries over a
  cached history, against `attention.causal.causal_attention`.
"""

from __future__ import annotations

import random

import torch

from ...attention.causal import causal_attention
from ...config import ModelConfig
from ...model.layers import RMSNorm
from .check import Case, Verdict, close_tensors, run_cases, same_value


def check_rms_norm(fn: object) -> Verdict:
    """`rms_norm(x, weight, eps) -> Tensor`: x (..., hidden) float32, weight (hidden,), eps a float;
    returns x / sqrt(mean(x^2 over the last dim) + eps) * weight, the same shape as x."""

    def cases() -> list[Case]:
        generator = torch.Generator().manual_seed(1)
        shapes = [(1, 4), (2, 6), (3, 1, 8), (2, 5, 16)]
        eps_values = [1e-6, 1e-5, 1e-2, 0.5]
        scales = [1.0, 1e-3, 10.0, 0.05]  # small inputs: where eps stops being negligible
        out = []
        for shape, eps, scale in zip(shapes * 2, eps_values * 2, scales + scales[::-1]):
            x = torch.randn(shape, generator=generator) * scale
            weight = 1 + 0.5 * torch.randn(shape[-1], generator=generator)
            norm = RMSNorm(shape[-1], eps)
            with torch.no_grad():
                norm.weight.copy_(weight)
                expected = norm(x)
            out.append(Case({"x": x, "weight": weight, "eps": eps}, expected))
        return out

    return run_cases("rms_norm", fn, cases, close_tensors(rtol=1e-4, atol=1e-6), "llm_runtime.model.layers.RMSNorm")


def _config(rng: random.Random, **fixed: int) -> ModelConfig:
    num_kv_heads = fixed.get("num_kv_heads", rng.choice([1, 2, 4, 8]))
    num_heads = fixed.get("num_heads", num_kv_heads * rng.choice([1, 2, 3, 4]))
    head_dim = fixed.get("head_dim", rng.choice([32, 64, 128]))
    hidden = fixed.get("hidden_size", num_heads * rng.choice([32, 64, 96]))  # head_dim need not be hidden / heads
    return ModelConfig(model_type="llama", vocab_size=1000, hidden_size=hidden, intermediate_size=4 * hidden,
                       num_layers=fixed.get("num_layers", rng.randint(1, 48)), num_heads=num_heads,
                       num_kv_heads=num_kv_heads, head_dim=head_dim, max_position_embeddings=4096)


def check_kv_bytes_per_token(fn: object) -> Verdict:
    """`kv_bytes_per_token(config, dtype_size) -> int`: bytes of keys and values one token takes in the
    cache, over all layers, for a `ModelConfig` and an element size in bytes (2 for bfloat16)."""

    def cases() -> list[Case]:
        rng = random.Random(1)
        configs = [
            _config(rng, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, hidden_size=576),  # SmolLM2-135M
            _config(rng, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, hidden_size=4096),  # Llama-3-8B
            _config(rng, num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128, hidden_size=1024),  # Qwen3-0.6B
        ] + [_config(rng) for _ in range(9)]
        return [Case({"config": config, "dtype_size": size}, config.kv_bytes_per_token(size))
                for config in configs for size in (2, rng.choice([1, 4]))]

    return run_cases("kv_bytes_per_token", fn, cases, same_value, "llm_runtime.ModelConfig.kv_bytes_per_token")


def check_gqa_attention(fn: object) -> Verdict:
    """`gqa_attention(q, k, v, num_cached) -> Tensor`: q (B, num_heads, T, head_dim) holds positions
    num_cached .. num_cached + T - 1; k, v (B, num_kv_heads, num_cached + T, head_dim) hold every
    position from 0, each KV head shared by num_heads // num_kv_heads consecutive query heads (query
    head h reads KV head h // group). Query i may attend to keys 0 .. num_cached + i; scores are scaled
    by 1 / sqrt(head_dim). Returns (B, num_heads, T, head_dim)."""

    def cases() -> list[Case]:
        rng, generator = random.Random(1), torch.Generator().manual_seed(1)
        # (batch, num_kv_heads, group, new tokens, cached tokens, head_dim); small failures show first
        shapes = [(1, 1, 1, 3, 0, 4), (1, 2, 1, 4, 0, 4), (1, 1, 2, 3, 2, 4), (1, 2, 2, 1, 0, 2), (2, 2, 2, 1, 5, 8)]
        shapes += [(rng.randint(1, 2), rng.randint(1, 3), rng.randint(1, 3), rng.randint(1, 5), rng.randint(0, 6),
                    rng.choice([4, 8])) for _ in range(10)]
        out = []
        for batch, num_kv_heads, group, num_new, num_cached, head_dim in shapes:
            q = torch.randn(batch, num_kv_heads * group, num_new, head_dim, generator=generator)
            k = torch.randn(batch, num_kv_heads, num_cached + num_new, head_dim, generator=generator)
            v = torch.randn(batch, num_kv_heads, num_cached + num_new, head_dim, generator=generator)
            out.append(Case({"q": q, "k": k, "v": v, "num_cached": num_cached},
                            causal_attention(q, k, v, num_cached)))
        return out

    return run_cases("gqa_attention", fn, cases, close_tensors(rtol=1e-4, atol=1e-5),
                     "llm_runtime.attention.causal.causal_attention")
