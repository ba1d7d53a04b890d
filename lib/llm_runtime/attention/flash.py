"""FlashAttention 2 over the paged pool, where it is installed and the GPU supports it (optional).

`flash_attn_varlen_func` takes the whole ragged batch at once (cumulative query and key lengths)
and, with `block_table`, reads keys and values straight out of the paged pool; `causal=True` aligns
each sequence's queries with its last keys, so prefill chunks, extends and decodes share one call.
FlashAttention 2 runs on Ampere and newer GPUs (sm80+: A100, RTX 30xx, L4, H100) in float16 or
bfloat16; a T4 (sm75) or a CPU falls back to the Triton or block-wise backend. Its paged mode needs
blocks of a multiple of 256 tokens (vLLM ships its own build for 16-token blocks), so the engine only
picks it when `block_size` allows. Install it with `pip install flash-attn` on a CUDA machine.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from .backend import AttentionBackend
from .metadata import AttentionMetadata

FLASH_BLOCK_MULTIPLE = 256  # the paged KV block size flash-attn 2 accepts: a multiple of this


@dataclass(frozen=True)
class FlashPlan:
    metadata: AttentionMetadata
    cu_seqlens_k: torch.Tensor  # (B + 1,) int32: cumulative keys per sequence


class FlashAttentionBackend(AttentionBackend):
    """One `flash_attn_varlen_func` call per layer for the whole mixed batch, over the block table."""

    name = "flash-attn"

    @classmethod
    def is_available(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        if device.type != "cuda":
            return "FlashAttention 2 needs a CUDA GPU"
        if importlib.util.find_spec("flash_attn") is None:
            return "flash-attn is not installed (pip install flash-attn)"
        if torch.cuda.get_device_capability(device) < (8, 0):
            return "FlashAttention 2 needs compute capability 8.0 or newer (this GPU is older, e.g. a T4 is 7.5)"
        if dtype not in (torch.float16, torch.bfloat16):
            return f"FlashAttention 2 runs in float16 or bfloat16, not {dtype}"
        return None

    @classmethod
    def supports_block_size(cls, block_size: int) -> str | None:
        if block_size % FLASH_BLOCK_MULTIPLE:
            return f"flash-attn's paged mode needs block_size a multiple of {FLASH_BLOCK_MULTIPLE}, not {block_size}"
        return None

    def plan(self, metadata: AttentionMetadata) -> FlashPlan:
        seq_lens = metadata.seq_lens
        cu_seqlens_k = torch.zeros(seq_lens.shape[0] + 1, dtype=torch.int32, device=seq_lens.device)
        cu_seqlens_k[1:] = torch.cumsum(seq_lens, 0)
        return FlashPlan(metadata, cu_seqlens_k)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_pool: torch.Tensor,
                value_pool: torch.Tensor, plan: FlashPlan) -> torch.Tensor:
        from flash_attn import flash_attn_varlen_func

        metadata = plan.metadata
        return flash_attn_varlen_func(
            query, key_pool, value_pool,  # q (N, H, d); pools (num_blocks, block_size, KV, d)
            cu_seqlens_q=metadata.query_start_loc, cu_seqlens_k=plan.cu_seqlens_k,
            max_seqlen_q=metadata.max_query_len, max_seqlen_k=metadata.max_seq_len,
            causal=True, block_table=metadata.block_tables,
        )  # (N, H, d)
