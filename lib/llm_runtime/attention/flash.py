"""FlashAttention 2 over the paged pool, where it is installed and the GPU supports it (optional).

`flash_attn_varlen_func` takes the whole ragged batch at once (cumulative query and key lengths)
and, with `block_table`, reads keys and values straight out of the paged pool; `causal=True` aligns
each sequence's queries with its last keys, so prefill chunks, extends and decodes share one call.
FlashAttention 2 runs on Ampere and newer GPUs (sm80+: A100, RTX 30xx, L4, H100) in float16 or
bfloat16; a T4 (sm75) or a CPU falls back to the Triton or block-wise backend.

Its paged mode needs blocks of a multiple of 256 tokens: flash-attn 2's C++ entry points refuse any
other `page_block_size` ("Paged KV cache block size must be divisible by 256"; the maintainers'
answer in Dao-AILab/flash-attention#828 is that 256 was easier to implement; vLLM ships its own
build for 16-token blocks). The engine's default block is 16 tokens, so the selector skips this
backend unless `block_size` is a multiple of 256, and a request for it by name says why. The
`block_table` argument of the varlen entry point arrived after paged KV itself (flash-attn#831),
so an older install is refused too. Install it with `pip install flash-attn` on a CUDA machine.
"""

from __future__ import annotations

import importlib.util
import inspect
from dataclasses import dataclass

import torch

from ..device import device_profile
from .backend import AttentionBackend
from .metadata import AttentionMetadata

FLASH_BLOCK_MULTIPLE = 256  # the paged KV block size flash-attn 2 accepts: a multiple of this
FLASH_MIN_CAPABILITY = (8, 0)  # Ampere: the asynchronous copies and tensor-core shapes its kernels are built on
FLASH_DTYPES = (torch.float16, torch.bfloat16)


def capability_reason(capability: tuple[int, int], dtype: torch.dtype) -> str | None:
    """None when FlashAttention 2's kernels run on a GPU of compute `capability` in `dtype`; else why not.
    (Separate from the device query so that a test, or a lesson, can ask about a T4 on any machine.)"""
    if tuple(capability) < FLASH_MIN_CAPABILITY:
        major, minor = capability
        return (f"FlashAttention 2 needs compute capability 8.0 or newer (this GPU is {major}.{minor}; "
                f"a T4 is 7.5)")
    if dtype not in FLASH_DTYPES:
        return f"FlashAttention 2 runs in float16 or bfloat16, not {dtype}"
    return None


def _installed_reason() -> str | None:
    """None when flash-attn is installed with a varlen entry point that reads a block table; else why not."""
    if importlib.util.find_spec("flash_attn") is None:
        return "flash-attn is not installed (pip install flash-attn)"
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception as error:  # noqa: BLE001 - installed but broken (a build for another torch or CUDA)
        return f"flash-attn does not import ({type(error).__name__}: {error})"
    if "block_table" not in inspect.signature(flash_attn_varlen_func).parameters:
        return "this flash-attn's flash_attn_varlen_func takes no block_table (paged KV needs a newer flash-attn 2)"
    return None


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
            profile = device_profile(device)  # the CPU playing a GPU: that GPU's rule first, then the CPU's
            reason = capability_reason(profile.capability, dtype) if profile.emulated else None
            return reason or "FlashAttention 2 needs a CUDA GPU"
        return _installed_reason() or capability_reason(torch.cuda.get_device_capability(device), dtype)

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
