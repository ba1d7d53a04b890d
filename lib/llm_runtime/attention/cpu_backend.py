"""The `cpu` attention backend: decodes through this package's C kernel, prefill chunks block-wise.

On the CPU, a decode step is where attention's time goes: hundreds of single-row queries, each
over its own scattered blocks. The block-wise backend copies each tile of blocks into a workspace
before ATen's kernel can read it; the C kernel (`cpu_kernels.py`, `csrc/paged_decode.c`) reads the
blocks where they lie, one sequence per thread, and keeps the online softmax in registers. Prefill
chunks are matrix-shaped work that ATen's flash kernel already does well, so they stay on the
block-wise path (this class inherits it).

Available on the CPU in float32 and bfloat16 when a C compiler builds the kernel; otherwise the
engine falls back to `blockwise`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .blockwise import BlockwiseBackend, PrefillChunk, row_offsets
from .cpu_kernels import KERNEL_DTYPES, check_indices, kernel_unavailable_reason, paged_decode
from .metadata import AttentionMetadata


@dataclass(frozen=True)
class CpuDecodes:
    """The decode rows of one step, in the layout the C kernel reads."""

    rows: torch.Tensor  # (D,) int64: rows of the flat batch
    block_tables: torch.Tensor  # (D, max_blocks) int32, contiguous
    seq_lens: torch.Tensor  # (D,) int32
    max_block: int  # the largest block id in the tables (checked against each layer's pool)


@dataclass(frozen=True)
class CpuPlan:
    decodes: CpuDecodes | None
    prefills: list[PrefillChunk]


class CpuKernelBackend(BlockwiseBackend):
    """Decodes by the C kernel, prefill chunks by the block-wise path (module docstring)."""

    name = "cpu"

    @classmethod
    def is_available(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        if device.type != "cpu":
            return "the C kernel runs on the CPU"
        if dtype not in KERNEL_DTYPES:
            return f"the C kernel reads {' and '.join(str(t) for t in KERNEL_DTYPES)} pools, not {dtype}"
        return kernel_unavailable_reason()

    def plan(self, metadata: AttentionMetadata) -> CpuPlan:
        return CpuPlan(self._plan_decodes(metadata), self._plan_prefills(metadata))

    def _plan_decodes(self, metadata: AttentionMetadata) -> CpuDecodes | None:
        decode_rows = metadata.decode_rows
        if not decode_rows:
            return None
        offsets = row_offsets(metadata)
        index = torch.tensor(decode_rows, dtype=torch.long)
        rows = torch.tensor([offsets[b] for b in decode_rows], dtype=torch.long)
        block_tables = metadata.block_tables.cpu().index_select(0, index).contiguous()  # (D, max_blocks) int32
        seq_lens = metadata.seq_lens.cpu().index_select(0, index).contiguous()  # (D,) int32
        # The C code follows these indices without bounds checks: check them once per step, here (the
        # pool's size is known only per layer, so `forward` compares the largest block with it).
        max_block = int(block_tables.max())
        check_indices(block_tables, seq_lens, rows, num_rows=metadata.num_tokens, num_blocks=max_block + 1,
                      block_size=metadata.block_size)
        return CpuDecodes(rows, block_tables, seq_lens, max_block)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_pool: torch.Tensor,
                value_pool: torch.Tensor, plan: CpuPlan) -> torch.Tensor:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # (N, H, d), contiguous
        if plan.decodes is not None:
            decodes = plan.decodes
            if decodes.max_block >= key_pool.shape[0]:
                raise ValueError(f"block {decodes.max_block} is outside a pool of {key_pool.shape[0]} blocks")
            if query.stride(-1) != 1:
                query = query.contiguous()
            paged_decode(query, key_pool, value_pool, decodes.block_tables, decodes.seq_lens, decodes.rows, out,
                         indices_checked=True)
        self._attend_prefills(query, key, value, key_pool, value_pool, plan.prefills, out)
        return out
