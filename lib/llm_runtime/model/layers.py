"""The blocks of a Llama-family decoder layer: RMSNorm, the gated MLP and grouped-query self-attention.

Parameter names match Hugging Face checkpoints (`self_attn.q_proj`, `mlp.gate_proj`, ...), so a
checkpoint's state dict loads without renaming.

Sharded over ranks (distributed/sharding.py, lesson 17), a layer holds its rank's heads and its slice of the MLP,
and `tp` is set: the attention and the MLP each end with one all-reduce of their row-parallel projection.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ..attention.causal import causal_attention
from ..config import ModelConfig
from ..attention.kv_cache import KVCache
from .pointwise import EAGER_OPS

if TYPE_CHECKING:
    from ..distributed.group import TensorParallelGroup


class RMSNorm(nn.Module):
    """x / rms(x) * weight, normalised in float32 as the reference implementation does."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.ops = EAGER_OPS  # eager or compiled (pointwise.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    # Packing for the CPU multiplies gate and up as one matrix (model/packed_linear.py).
    FUSED_PROJECTIONS = {"gate_up_proj": ("gate_proj", "up_proj")}

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(hidden, inner, bias=bias)
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)
        self.gate_up_proj: nn.Module | None = None  # gate and up as one, once packed
        self.ops = EAGER_OPS
        self.tp: TensorParallelGroup | None = None  # sharded: down's partial sums are added over the ranks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # (..., 2 * inner) -> two (..., inner)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        out = self.down_proj(self.ops.silu_and_mul(gate, up))
        return out if self.tp is None else self.tp.all_reduce(out)


class Attention(nn.Module):
    """Self-attention with grouped-query heads, rotary positions and an explicit KV cache."""

    FUSED_PROJECTIONS = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}  # one matrix once packed

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        # Qwen3 normalises each head of q and k before the rotation.
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.qkv_proj: nn.Module | None = None  # q, k and v as one, once packed
        self.ops = EAGER_OPS
        self.tp: TensorParallelGroup | None = None  # sharded: o's partial sums are added over the ranks

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache | None,
    ) -> torch.Tensor:
        """x (B, T, hidden) -> (B, T, hidden), reading and extending `kv_cache` when given."""
        batch, num_new, _ = x.shape
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split(self.qkv_proj.part_sizes, dim=-1)  # (B, T, (H + 2 KV) d) -> 3 parts
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(batch, num_new, self.num_heads, self.head_dim)  # (B, T, H, d)
        k = k.view(batch, num_new, self.num_kv_heads, self.head_dim)  # (B, T, KV, d)
        v = v.view(batch, num_new, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, d)
        q, k = self.ops.rotary(q, cos, sin), self.ops.rotary(k, cos, sin)

        if kv_cache is None:
            out = causal_attention(q, k, v, num_cached=0)  # (B, H, T, d): the whole sequence is here
        else:
            out = kv_cache.attend(self.layer_idx, q, k, v)  # stores k, v and attends over all cached
        out = out.transpose(1, 2).reshape(batch, num_new, self.num_heads * self.head_dim)  # (B, T, H*d)
        out = self.o_proj(out)
        return out if self.tp is None else self.tp.all_reduce(out)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache | None
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))
