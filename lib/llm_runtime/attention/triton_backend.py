"""The `triton` attention backend: this package's own Triton kernels over the paged pool.

Per step, `plan` decides how the batch is attended: the unified kernel (prefill chunks, extends
and decodes in one launch), or, for a batch of decodes only over long contexts with too few
(sequence, KV head) programs to fill the GPU, the split-KV (flash-decoding) path. Per layer,
`store_kv` launches the store kernel and `forward` the chosen attention kernel(s). Nothing is
gathered out of the pool, and no mask is built: the kernels read block tables directly.

Triton is imported only when a kernel is first needed, so the package imports without it. On a
machine without a GPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, read by
Triton itself, so it must be set before triton is first imported): slow, but it lets CPU-only CI
test them.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Literal

import torch

from .backend import AttentionBackend
from .metadata import AttentionMetadata

SplitKV = Literal["auto", "always", "never"]


@dataclass(frozen=True)
class TritonPlan:
    """Per step: the metadata's device tensors, and which kernel path every layer takes."""

    query_start_loc: torch.Tensor  # (B + 1,) int32
    seq_lens: torch.Tensor  # (B,) int32
    block_tables: torch.Tensor  # (B, max_num_blocks) int32
    max_query_len: int
    num_splits: int  # > 0: split-KV decode with this many partitions per sequence; 0: unified kernel
    partition_size: int  # keys per split-KV partition


class TritonBackend(AttentionBackend):
    """Paged attention with this package's Triton kernels (see `triton_kernels.py`).

    `split_kv` chooses the decode path: "auto" splits a decode-only step whose sequences are fewer
    than the GPU's multiprocessors and whose longest context spans at least two partitions;
    "always" splits every decode-only step, "never" always runs the unified kernel (both for tests
    and measurements). `partition_size` is the keys per split-KV partition (a multiple of 32).
    `block_m` fixes the unified kernel's rows per program (None: 16, or 64 when the step has long
    chunks, chosen per step).
    """

    name = "triton"
    supports_cuda_graphs = True  # a captured plan keeps its kernel path; the kernels read lengths on the device

    def __init__(self, split_kv: SplitKV = "auto", partition_size: int = 512, block_m: int | None = None) -> None:
        if split_kv not in ("auto", "always", "never"):
            raise ValueError(f"split_kv must be 'auto', 'always' or 'never', got {split_kv!r}")
        if partition_size < 32 or partition_size % 32:
            raise ValueError(f"partition_size must be a positive multiple of 32, got {partition_size}")
        if block_m is not None and (block_m < 16 or block_m & (block_m - 1)):
            raise ValueError(f"block_m must be a power of two >= 16, got {block_m}")
        self.split_kv = split_kv
        self.partition_size = partition_size
        self.block_m = block_m

    @classmethod
    def batch_invariant(cls) -> "TritonBackend":
        """The unified kernel always (never split-KV, whose partition count follows the batch), with one tile
        of query rows for every step: a row's keys are walked in steps of 32 from the first, with the same
        compiled instructions, in a decode and in a prefill chunk alike."""
        return cls(split_kv="never", block_m=16)

    @classmethod
    def is_available(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            return f"the Triton kernels support float32, float16 and bfloat16, not {dtype}"
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed"
        try:
            import triton  # noqa: F401
        except ImportError as error:  # installed but broken (e.g. a mismatched build)
            return f"triton does not import: {error}"
        device = torch.device(device)
        if device.type == "cuda":
            return None
        # Triton's own switch, which Triton reads itself; looked at here only to say whether it is on.
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
            return None
        return "Triton needs a CUDA GPU (or TRITON_INTERPRET=1 on the CPU)"

    def decode_workspace_bytes(self, num_seqs: int, max_seq_len: int, num_heads: int, head_dim: int) -> int:
        """The split-KV partials: a running max, a sum and a head_dim accumulator in float32 per
        (sequence, head, partition)."""
        if self.split_kv == "never":
            return 0
        num_splits = -(-max_seq_len // self.partition_size)
        return num_seqs * num_heads * num_splits * (head_dim + 2) * 4

    def plan(self, metadata: AttentionMetadata) -> TritonPlan:
        num_splits = 0
        all_decodes = metadata.num_seqs > 0 and metadata.max_query_len == 1
        if all_decodes and self.split_kv != "never":
            parts = -(-metadata.max_seq_len // self.partition_size)
            if self.split_kv == "always":
                num_splits = parts
            elif parts >= 2 and metadata.num_seqs < _multiprocessor_count(metadata.seq_lens.device):
                # Few sequences, long contexts: the unified grid (B x KV programs) would leave
                # most multiprocessors idle while each program walks thousands of keys.
                num_splits = parts
        return TritonPlan(
            query_start_loc=metadata.query_start_loc,
            seq_lens=metadata.seq_lens,
            block_tables=metadata.block_tables,
            max_query_len=metadata.max_query_len,
            num_splits=num_splits,
            partition_size=self.partition_size,
        )

    def store_kv(
        self,
        key_pool: torch.Tensor,
        value_pool: torch.Tensor,
        slot_mapping: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
    ) -> None:
        from . import triton_kernels

        triton_kernels.store_kv(key, value, key_pool, value_pool, slot_mapping)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_pool: torch.Tensor,
                value_pool: torch.Tensor, plan: TritonPlan) -> torch.Tensor:
        # This step's key and value are already in the pool: the kernels read every key from there.
        from . import triton_kernels

        scale = query.shape[-1] ** -0.5
        if plan.num_splits:
            return triton_kernels.split_kv_decode_attention(
                query, key_pool, value_pool, plan.block_tables, plan.seq_lens, plan.query_start_loc,
                num_splits=plan.num_splits, partition_size=plan.partition_size, scale=scale)
        return triton_kernels.unified_attention(
            query, key_pool, value_pool, plan.block_tables, plan.seq_lens, plan.query_start_loc,
            max_query_len=plan.max_query_len, scale=scale, block_m=self.block_m)


def _multiprocessor_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 elsewhere (the interpreter runs programs one by one)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count
