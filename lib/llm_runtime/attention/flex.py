"""Paged attention with FlexAttention: the pool read in place through a sparse block mask, compiled.

`torch.nn.attention.flex_attention` computes softmax(QK^T)V for any mask given as a function
`mask_mod(b, h, q_idx, kv_idx) -> bool`, and skips whole tiles of the score matrix that a
`BlockMask` marks empty. torch.compile turns it into one fused kernel: inductor's C++ template on
the CPU, a Triton kernel on CUDA. Paged attention fits it without copying the pool:

- the keys are the layer's whole pool seen as one long sequence, (1, KV, num_blocks * block_size, d),
  a view; a key tile of the block mask is one pool block, so a block table *is* a list of key tiles;
- the queries are the step's rows as one query sequence. The query heads that share a KV head are
  folded into it, (1, KV, M * group, d), row r = token r // group, so one tile's GEMM serves a
  whole GQA group and reads each key once for all of them;
- a query tile holds `tile_tokens` tokens of one sequence (a prefill chunk is padded to whole tiles)
  and lists that sequence's blocks: those every token of the tile sees entirely are "full" (no mask
  is evaluated on them), the one or two around the tile's positions "partial", and there
  `mask_mod` keeps a key iff its logical position is <= the query's position.

Decodes and prefill chunks run as two calls with different tiles: on the CPU the kernel's GEMM tile
is the mask's tile, so a decode gets a tile to itself (a tile shared by several decodes would
attend over all their blocks and throw most of it away), prefill chunks tiles of
`prefill_tile_tokens`. The block masks' index tensors are built once per step (in `plan`, widened
to the pool at the first layer); the kernel is compiled with the per-step sizes dynamic, so a
new step does not recompile (one graph for decodes, one for prefills).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .backend import AttentionBackend
from .metadata import AttentionMetadata

try:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError as _error:  # torch < 2.5
    BlockMask = flex_attention = None  # type: ignore[assignment,misc]
    _IMPORT_ERROR: str | None = str(_error)
else:
    _IMPORT_ERROR = None

_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what inductor's CPU template supports


def paged_causal_mask(
    positions: torch.Tensor, partial_blocks: torch.Tensor, tile_tokens: int, group: int, block_size: int
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The mask_mod of a tile's partial blocks: key slot kv_idx is visible to query row q_idx (token
    q_idx // group) iff the slot's logical position is <= the token's position.

    positions (M,) each token's position in its sequence; partial_blocks (T, 1 + K) per tile the
    logical index of its first partial block, then its K partial blocks, physical, in logical
    order (-1 padded). Only a tile's own partial blocks reach the mask (the block mask decides full
    and unlisted ones), so a block's logical index is the first one's plus its place in that list.
    """
    width = partial_blocks.shape[1] - 1

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        token = q_idx // group
        tile = token // tile_tokens
        block = kv_idx // block_size
        logical = partial_blocks[tile, 0]
        for k in range(1, width):  # unrolled when traced: width is 2 or 3
            logical = logical + torch.where(partial_blocks[tile, 1 + k] == block, k, 0)
        return logical * block_size + kv_idx % block_size <= positions[token]

    return mask_mod


def paged_flex_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    partial_blocks: torch.Tensor,
    partial_count: torch.Tensor,
    partial_indices: torch.Tensor,
    full_count: torch.Tensor,
    full_indices: torch.Tensor,
    tile_tokens: int,
    group: int,
    block_size: int,
) -> torch.Tensor:
    """query (1, KV, M * group, d) over keys, values (1, KV, num_blocks * block_size, d) -> like query.

    Tile t (tile_tokens tokens, tile_tokens * group rows) sees blocks full_indices[t, :full_count[t]]
    whole and partial_indices[t, :partial_count[t]] through `paged_causal_mask`; index rows are as
    wide as the pool (inductor's CPU template checks it). The block mask is built here, inside the
    compiled region, so that its sizes are the tensors' dynamic sizes, not Python ints the compiler
    would specialize on. (The four block-mask tensors must be distinct buffers: inductor's CPU
    template names its pointers by buffer.)
    """
    block_mask = BlockMask.from_kv_blocks(
        partial_count[None, None], partial_indices[None, None],  # (1, 1, T), (1, 1, T, num_blocks)
        full_count[None, None], full_indices[None, None],
        BLOCK_SIZE=(tile_tokens * group, block_size),
        mask_mod=paged_causal_mask(positions, partial_blocks, tile_tokens, group, block_size),
        seq_lengths=(query.shape[2], keys.shape[2]),
        compute_q_blocks=False,
    )
    return flex_attention(query, keys, values, block_mask=block_mask)


@dataclass
class FlexPart:
    """One flex_attention call's tokens: the decodes, or the prefill chunks padded to whole tiles."""

    tile_tokens: int
    rows: torch.Tensor  # (M,) flat-batch row of each token (padding repeats a chunk's last row)
    out_rows: torch.Tensor  # (M,) where each token's output goes: its row, or N for padding
    positions: torch.Tensor  # (M,) int32
    partial_blocks: torch.Tensor  # (T, 1 + K) int32, T = M / tile_tokens: first logical index, physical blocks
    partial_count: torch.Tensor  # (T,) int32
    full_count: torch.Tensor  # (T,) int32: blocks every token of the tile sees whole
    tables: torch.Tensor  # (T, max_num_blocks) int32: each tile's sequence's block table
    indices: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def block_indices(self, num_pool_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(partial, full) block indices (T, num_pool_blocks): rows as wide as the pool, built at the first layer."""
        pair = self.indices.get(num_pool_blocks)
        if pair is None:
            num_tiles, width = self.tables.shape
            if width > num_pool_blocks:
                raise ValueError(f"block tables {width} blocks wide, pool of {num_pool_blocks}")
            partial = torch.zeros(num_tiles, num_pool_blocks, dtype=torch.int32, device=self.tables.device)
            partial[:, : self.partial_blocks.shape[1] - 1] = self.partial_blocks[:, 1:].clamp(min=0)
            full = torch.zeros_like(partial)
            full[:, :width] = self.tables
            pair = self.indices[num_pool_blocks] = (partial, full)
        return pair


@dataclass(frozen=True)
class FlexPlan:
    """Per step: the decodes' call and the prefill chunks' call (None where the step has none)."""

    decodes: FlexPart | None
    prefills: FlexPart | None


def build_part(metadata: AttentionMetadata, seqs: list[int], tile_tokens: int) -> FlexPart:
    """The tokens, positions and per-tile block lists of sequences `seqs`, each padded to whole tiles."""
    size = metadata.block_size
    device = metadata.block_tables.device
    query_lens = torch.tensor([metadata.query_lens_host[b] for b in seqs], dtype=torch.long)  # (S,)
    contexts = torch.tensor([metadata.context_lens_host[b] for b in seqs], dtype=torch.long)
    starts = torch.tensor(metadata.query_start_loc.tolist(), dtype=torch.long)[seqs]  # (S,) first flat row
    padded = -(-query_lens // tile_tokens) * tile_tokens  # (S,) tokens after padding
    # At least two tiles: the compiler specializes sizes 0 and 1, so a one-tile call would compile anew.
    padded[-1] += max(0, 2 * tile_tokens - int(padded.sum()))
    seq_of_token = torch.repeat_interleave(torch.arange(len(seqs)), padded)  # (M,)
    local = torch.arange(seq_of_token.shape[0]) - (torch.cumsum(padded, 0) - padded)[seq_of_token]  # (M,)
    real = local < query_lens[seq_of_token]
    local = torch.minimum(local, query_lens[seq_of_token] - 1)  # padding repeats the chunk's last token
    rows = starts[seq_of_token] + local  # (M,)
    positions = contexts[seq_of_token] + local  # (M,)

    seq_of_tile = seq_of_token[::tile_tokens]  # (T,)
    first_pos, last_pos = positions[::tile_tokens], positions[tile_tokens - 1 :: tile_tokens]  # (T,)
    full_count = torch.div(first_pos + 1, size, rounding_mode="floor")  # blocks ending at or before first_pos
    partial_count = torch.div(last_pos, size, rounding_mode="floor") + 1 - full_count
    tables = metadata.block_tables.cpu()[torch.tensor(seqs)[seq_of_tile]]  # (T, max_num_blocks)
    width = (tile_tokens + size - 2) // size + 1  # most blocks tile_tokens consecutive positions touch
    logical = full_count[:, None] + torch.arange(width)  # (T, K)
    partial_blocks = torch.gather(tables, 1, logical.clamp(max=tables.shape[1] - 1))
    partial_blocks = partial_blocks.masked_fill(torch.arange(width) >= partial_count[:, None], -1)
    int32 = {"dtype": torch.int32, "device": device}
    return FlexPart(
        tile_tokens=tile_tokens,
        rows=rows.to(device),
        out_rows=rows.masked_fill(~real, metadata.num_tokens).to(device),
        positions=positions.to(**int32),
        partial_blocks=torch.cat([full_count[:, None], partial_blocks], 1).to(**int32),
        partial_count=partial_count.to(**int32),
        full_count=full_count.to(**int32),
        tables=tables.to(**int32),
    )


class FlexAttentionBackend(AttentionBackend):
    """Paged attention as compiled FlexAttention over the pool in place (module docstring).

    A prefill tile holds `prefill_tile_tokens` tokens of one chunk, a decode tile
    `decode_tile_tokens` (1: a decode's own token). On the CPU a tile's tokens times the GQA group
    are the kernel's GEMM rows. On CUDA (not yet run: no GPU where this was written) Triton's kernel
    may want tiles of at least 16 rows.
    """

    name = "flex"
    reads_whole_pool = True  # compiled for the pool's size (a quantized pool is read back whole)

    def __init__(self, prefill_tile_tokens: int = 16, decode_tile_tokens: int = 1) -> None:
        if prefill_tile_tokens < 1 or decode_tile_tokens < 1:
            raise ValueError("prefill_tile_tokens and decode_tile_tokens must be >= 1")
        self.prefill_tile_tokens = prefill_tile_tokens
        self.decode_tile_tokens = decode_tile_tokens
        self._compiled: Callable[..., torch.Tensor] | None = None  # compiled at the first forward

    @classmethod
    def is_available(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        if _IMPORT_ERROR is not None:
            return f"torch.nn.attention.flex_attention cannot be imported ({_IMPORT_ERROR})"
        if device.type == "cpu":
            if dtype not in _CPU_DTYPES:
                return f"inductor's CPU FlexAttention template does not support {dtype}"
            try:
                from torch._inductor.cpp_builder import get_cpp_compiler
                from torch._inductor.kernel.flex.flex_cpu import check_cpu_supported

                get_cpp_compiler()
            except Exception as error:  # noqa: BLE001 - any failure means inductor cannot build the kernel
                return f"inductor cannot compile C++ here ({type(error).__name__}: {error})"
            if not check_cpu_supported():
                return "inductor's CPU FlexAttention template needs an x86 CPU with AVX2"
            return None
        if device.type == "cuda":
            from torch.utils._triton import has_triton

            return None if has_triton() else "Triton is not installed"
        return f"no FlexAttention kernel for device type {device.type!r}"

    def plan(self, metadata: AttentionMetadata) -> FlexPlan:
        decodes = metadata.decode_rows
        prefills = [b for b, count in enumerate(metadata.query_lens_host) if count > 1]
        return FlexPlan(build_part(metadata, decodes, self.decode_tile_tokens) if decodes else None,
                        build_part(metadata, prefills, self.prefill_tile_tokens) if prefills else None)

    def _attend(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, part: FlexPart,
                block_size: int, out: torch.Tensor) -> None:
        """Attend the part's tokens: query (N, H, d), keys, values (1, KV, pool slots, d); results into
        out (N + 1, H, d) at their rows (padding tokens into the spare last row)."""
        if self._compiled is None:
            # Static by default (heads, head size, pool size and tiles are fixed for an engine); only
            # the per-step sizes are marked dynamic below, so a new step does not recompile. Dynamo
            # keeps its compiled graphs per code object, at most `recompile_limit` (8) of them, and past
            # that runs the function eagerly (dense masks over the whole pool): a copy of the code
            # per backend gives each engine its own graphs, however many engines a process makes.
            code = paged_flex_attention.__code__.replace()
            function = types.FunctionType(code, paged_flex_attention.__globals__, paged_flex_attention.__name__)
            self._compiled = torch.compile(function, dynamic=False, fullgraph=True)
        num_tokens = part.rows.shape[0]
        num_heads, head_dim = query.shape[1:]
        num_kv_heads = keys.shape[1]
        group = num_heads // num_kv_heads
        q = query.view(-1, num_kv_heads, group, head_dim).transpose(0, 1)[:, part.rows]  # (KV, M, G, d), one copy
        q = q.view(1, num_kv_heads, num_tokens * group, head_dim)  # (1, KV, M * G, d)
        partial, full = part.block_indices(keys.shape[2] // block_size)
        tensors = (part.positions, part.partial_blocks, part.partial_count, partial, part.full_count, full)
        torch._dynamo.mark_dynamic(q, 2)
        for tensor in tensors:
            torch._dynamo.mark_dynamic(tensor, 0)
        result = self._compiled(q, keys, values, *tensors, part.tile_tokens, group, block_size)  # (1, KV, M * G, d)
        result = result.view(num_kv_heads, num_tokens, group, head_dim).transpose(0, 1)  # (M, KV, G, d)
        out.view(-1, num_kv_heads, group, head_dim).index_copy_(0, part.out_rows, result)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_pool: torch.Tensor,
                value_pool: torch.Tensor, plan: FlexPlan) -> torch.Tensor:
        num_pool_blocks, block_size, num_kv_heads, head_dim = key_pool.shape
        # The pool as one long key sequence, in place: (1, KV, num_blocks * block_size, d).
        keys = key_pool.view(1, num_pool_blocks * block_size, num_kv_heads, head_dim).transpose(1, 2)
        values = value_pool.view(1, num_pool_blocks * block_size, num_kv_heads, head_dim).transpose(1, 2)
        out = query.new_empty(query.shape[0] + 1, *query.shape[1:])  # (N + 1, H, d): a spare row for padding
        for part in (plan.decodes, plan.prefills):
            if part is not None:
                self._attend(query, keys, values, part, block_size, out)
        return out[:-1]
