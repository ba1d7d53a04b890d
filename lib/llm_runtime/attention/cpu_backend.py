"""The `cpu` attention backend: the query rows of the mixed batch through this package's C kernel.

On the CPU, a decode step is where attention's time goes: hundreds of single-row queries, each
over its own scattered blocks. The block-wise backend copies each tile of blocks into a workspace
before ATen's kernel can read it; the C kernel (`cpu_kernels.py`, `csrc/paged_decode.c`) reads the
blocks where they lie, one query row per work item, and keeps the online softmax in registers.

A prefill chunk needs no other code: its row at position p is a decode over the sequence's first
p + 1 keys (the chunk's own keys are in the pool already, stored before attention runs). So the
plan turns the ragged batch into one list of rows, each with its own length and block table, and
one kernel call per layer serves decodes and prefill chunks alike, as vLLM's unified Triton kernel
does on a GPU. Row by row is not matrix-shaped work, though: for a long chunk the block-wise path's
ATen kernel (blocked like a matrix multiply) wins, so chunks of more than `kernel_max_rows` rows go
there (this class inherits it). Measured here, with the bundled model: a 512-token prompt took 119
ms of attention by the kernel and 135 ms block-wise, a 2048-token one 1.83 s and 1.27 s; the
standard bench's prompts (12-128 tokens) 0.6-1.1 s in all against 2.3 s. The new keys and values
go into the pool by a C call too (`csrc/store_kv.c`).

An 8-bit pool (`kv_cache_dtype` "int8" or "fp8", kv_quant.py) is read where it lies too
(`forward_quantized`): the kernel converts each stored element to float32 as it loads it (int8's
keys scaled and turned to their positions a chunk at a time, its output scaled into values), so
the rows it serves need no full-precision copy of their blocks. Long prefill chunks stay block-wise
over a copy of the blocks their cached prefixes read, and only those (`QuantizedPrefills`).

Available on the CPU in float32 and bfloat16 when a C compiler builds the kernel; otherwise the
engine falls back to `blockwise`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from . import cpu_kernels
from .blockwise import BlockwiseBackend, PrefillChunk
from .cpu_kernels import KERNEL_DTYPES, check_indices, kernel_unavailable_reason, paged_decode, paged_decode_quantized
from .kv_quant import QuantizedPools
from .metadata import AttentionMetadata
from ..native.cpp_operators import cpp_operator


@dataclass(frozen=True)
class KernelRows:
    """Query rows in the layout the C kernel reads: row rows[i] attends to the first seq_lens[i] keys
    of block_tables[i]."""

    rows: torch.Tensor  # (R,) int64: rows of the flat batch
    block_tables: torch.Tensor  # (R, max_blocks) int32, contiguous: each row's sequence's table
    seq_lens: torch.Tensor  # (R,) int32: the row's position + 1
    max_block: int  # the largest block id in the tables (checked against each layer's pool)


@dataclass(frozen=True)
class QuantizedPrefills:
    """The long prefill chunks over an 8-bit pool: `prefills` with their prefix tiles renumbered to read
    a small full-precision copy of just the pool blocks `blocks` (block i of the copy is blocks[i])."""

    blocks: torch.Tensor  # (U,) int64: the pool blocks the chunks' cached prefixes read, ascending; may be empty
    prefills: list[PrefillChunk]
    block_starts: torch.Tensor  # (U,) int64: the position of each block's first token
    positions: torch.Tensor | None  # (N,) int64: each row's position (where there are chunks), for int8's keys


@dataclass(frozen=True)
class CpuPlan:
    kernel_rows: KernelRows | None  # decodes and the rows of short prefill chunks
    prefills: list[PrefillChunk]  # long prefill chunks, block-wise
    quantized_prefills: QuantizedPrefills  # the same over a copy of their blocks, for an 8-bit pool


class CpuKernelBackend(BlockwiseBackend):
    """Decodes and short prefill chunks by the C kernel, one row per work item; prefill chunks of more
    than `kernel_max_rows` rows block-wise (module docstring)."""

    name = "cpu"
    reads_quantized_kv = True  # an 8-bit pool through `forward_quantized`, in place

    def __init__(self, kernel_max_rows: int | None = 512, **blockwise: int) -> None:
        """`kernel_max_rows`: the longest chunk sent to the kernel (512: about where the two paths break even
        here); None sends every chunk, however long. `blockwise`: BlockwiseBackend's settings."""
        super().__init__(**blockwise)
        self.kernel_max_rows = 2**62 if kernel_max_rows is None else kernel_max_rows

    @classmethod
    def batch_invariant(cls) -> "CpuKernelBackend":
        """Every row through the kernel, which walks a row's keys in chunks of 16 from the first whatever else
        the step holds; long chunks too (block-wise, they would be tiled by the chunk's shape)."""
        return cls(kernel_max_rows=None)

    @classmethod
    def is_available(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        if device.type != "cpu":
            return "the C kernel runs on the CPU"
        if dtype not in KERNEL_DTYPES:
            return f"the C kernel reads {' and '.join(str(t) for t in KERNEL_DTYPES)} pools, not {dtype}"
        return kernel_unavailable_reason()

    def plan(self, metadata: AttentionMetadata) -> CpuPlan:
        prefills = self._plan_prefills(metadata, min_rows=self.kernel_max_rows + 1)
        return CpuPlan(self._plan_kernel_rows(metadata), prefills, quantized_prefills(prefills, metadata))

    def _plan_kernel_rows(self, metadata: AttentionMetadata) -> KernelRows | None:
        if metadata.query_lens_host and all(n == 1 for n in metadata.query_lens_host):
            return self._plan_decode_rows(metadata)
        return self._plan_mixed_rows(metadata)

    def _plan_mixed_rows(self, metadata: AttentionMetadata) -> KernelRows | None:
        """The kernel's rows for any batch: every row of a chunk of at most kernel_max_rows, each with its own
        length (its position + 1) and its sequence's table."""
        query_lens = torch.tensor(metadata.query_lens_host, dtype=torch.long)  # (B,)
        seq_of_row = torch.repeat_interleave(torch.arange(len(query_lens)), query_lens)  # (N,)
        rows = torch.arange(metadata.num_tokens, dtype=torch.long)
        positions = metadata.token_positions().cpu()  # (N,): each row sees keys 0 .. its position
        keep = query_lens[seq_of_row] <= self.kernel_max_rows  # (N,): the rows not left to the block-wise path
        if not bool(keep.all()):
            rows, positions, seq_of_row = rows[keep], positions[keep], seq_of_row[keep]
        if rows.numel() == 0:
            return None
        row_lens = (positions + 1).to(torch.int32)
        block_tables = metadata.block_tables.cpu().index_select(0, seq_of_row).contiguous()  # (R, max_blocks) int32
        # The C code follows these indices without bounds checks: check them once per step, here (the
        # pool's size is known only per layer, so `forward` compares the largest block with it).
        max_block = int(block_tables.max())
        check_indices(block_tables, row_lens, rows, num_rows=metadata.num_tokens, num_blocks=max_block + 1,
                      block_size=metadata.block_size)
        return KernelRows(rows, block_tables, row_lens, max_block)

    @staticmethod
    def _plan_decode_rows(metadata: AttentionMetadata) -> KernelRows:
        """`_plan_mixed_rows` for a step of one new token per sequence: row b is sequence b and attends to its
        seq_lens[b] keys, so the metadata's own tensors serve, and the indices are checked on the host's copies
        (a handful of Python comparisons instead of a dozen small PyTorch operations a step)."""
        tables = metadata.block_tables_host  # each long enough for its sequence (AttentionMetadata.build checks)
        width = metadata.block_tables.shape[1]
        if min(metadata.seq_lens_host) < 1 or max(metadata.seq_lens_host) > width * metadata.block_size:
            raise ValueError(f"seq_lens must lie in [1, {width * metadata.block_size}] for tables of {width} blocks")
        if any(block < 0 for table in tables for block in table):
            raise ValueError("block table entries must not be negative")
        max_block = max(max(table) for table in tables)
        rows = torch.arange(len(tables), dtype=torch.long)
        tables_tensor, lengths = metadata.block_tables.cpu().contiguous(), metadata.seq_lens.cpu().contiguous()
        return KernelRows(rows, tables_tensor, lengths, max_block)

    def store_kv(self, key_pool: torch.Tensor, value_pool: torch.Tensor, slot_mapping: torch.Tensor,
                 key: torch.Tensor, value: torch.Tensor) -> None:
        cpu_kernels.store_kv(key_pool, value_pool, slot_mapping, key, value)

    def compiled_inputs(self, plan: CpuPlan, num_blocks: int) -> tuple[torch.Tensor, ...] | None:
        """A step whose every row the kernel serves (no chunk longer than kernel_max_rows) runs compiled."""
        rows = plan.kernel_rows
        if rows is None or plan.prefills:
            return None
        _check_pool_size(rows, num_blocks)
        return rows.block_tables, rows.seq_lens, rows.rows

    def attend_compiled(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_pool: torch.Tensor,
                        value_pool: torch.Tensor, slot_mapping: torch.Tensor, *plan: torch.Tensor) -> torch.Tensor:
        block_tables, seq_lens, rows = plan
        attention = cpp_operator("cpu_paged_attention") or cpu_kernels.cpu_paged_attention  # C++ where loaded
        return attention(query, key, value, key_pool, value_pool, slot_mapping, block_tables, seq_lens, rows)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_pool: torch.Tensor,
                value_pool: torch.Tensor, plan: CpuPlan) -> torch.Tensor:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # (N, H, d), contiguous
        rows = plan.kernel_rows
        if rows is not None:
            _check_pool_size(rows, key_pool.shape[0])
            if query.stride(-1) != 1:
                query = query.contiguous()
            paged_decode(query, key_pool, value_pool, rows.block_tables, rows.seq_lens, rows.rows, out,
                         indices_checked=True)
        self._attend_prefills(query, key, value, key_pool, value_pool, plan.prefills, out)
        return out

    def store_quantized(self, pools: QuantizedPools, slot_mapping: torch.Tensor, key: torch.Tensor,
                        value: torch.Tensor, positions: torch.Tensor | None) -> None:
        if pools.quantization.name == "int8" and positions is not None:  # one C call (fp8: the Python path)
            cpu_kernels.store_kv_int8(pools, slot_mapping, key, value, positions)
        else:
            pools.write(slot_mapping, key, value, positions)

    def forward_quantized(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, pools: QuantizedPools,
                          plan: CpuPlan) -> torch.Tensor:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # (N, H, d), contiguous
        rows = plan.kernel_rows
        if rows is not None:  # the 8-bit pools as stored, converted in the kernel's registers
            _check_pool_size(rows, pools.key_pool.shape[0])
            if query.stride(-1) != 1:
                query = query.contiguous()
            paged_decode_quantized(query, pools.key_pool, pools.value_pool, pools.key_scale, pools.value_scale,
                                   rows.block_tables, rows.seq_lens, rows.rows, out, indices_checked=True,
                                   key_turns=pools.key_turns)
        if plan.prefills:
            # Chunks of more than kernel_max_rows rows stay block-wise, where ATen's blocked kernel beats the
            # row-by-row one (1.27 s against 1.83 s at 2048 rows, module docstring). It reads full-precision
            # keys: a copy of the blocks the chunks' cached prefixes read, and only those, made once per layer,
            # small beside the T x S attention that reads it (the chunks' own keys are `key` and `value`).
            # Sending these rows through the kernel instead would skip the copy but lose that speed.
            copy = plan.quantized_prefills
            key, value = pools.stored_as(key, value, copy.positions)  # as the pool holds them
            key_pool, value_pool = pools.read_blocks(copy.blocks, copy.block_starts, query.dtype)
            self._attend_prefills(query, key, value, key_pool, value_pool, copy.prefills, out)
        return out


def _check_pool_size(rows: KernelRows, num_blocks: int) -> None:
    """The per-layer half of the kernel's index check: the tables' largest block lies in a pool of `num_blocks`."""
    if rows.max_block >= num_blocks:
        raise ValueError(f"block {rows.max_block} is outside a pool of {num_blocks} blocks")


def quantized_prefills(prefills: list[PrefillChunk], metadata: AttentionMetadata) -> QuantizedPrefills:
    """The blocks the chunks' cached prefixes read, and the chunks with those blocks renumbered 0 .. U-1."""
    used = sorted({block for chunk in prefills for blocks, _ in chunk.prefix_tiles for block in blocks.tolist()})
    device = metadata.block_tables.device
    index = {block: i for i, block in enumerate(used)}
    compact = [replace(chunk, prefix_tiles=[(torch.tensor([index[b] for b in blocks.tolist()], device=device), keys)
                                            for blocks, keys in chunk.prefix_tiles])
               for chunk in prefills]
    starts = metadata.block_starts() if used else {}  # the blocks' positions and the rows': only where chunks are
    return QuantizedPrefills(torch.tensor(used, dtype=torch.int64, device=device), compact,
                             torch.tensor([starts[b] for b in used], dtype=torch.int64, device=device),
                             metadata.token_positions() if prefills else None)
