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

Decodes and prefill chunks run as two calls. On the CPU the kernel's GEMM tile is the mask's tile,
so a decode gets a tile to itself (a tile shared by several decodes would attend over all their
blocks and throw most of it away), prefill chunks tiles of `prefill_tile_tokens`. The kernel is
compiled with the per-step sizes dynamic, so a new step does not recompile (one graph for decodes,
one for prefills).

The block masks' index tensors are built once per step, at the first layer, sized by the step: (T, K)
partial and (T, widest block table) full. Both kernels read a row through its stride, and only its
first `kv_num_blocks` entries (flex_attention.py.jinja, cpp_flex_attention_template.py). One
exception: inductor's CPU template asserts that a partial row spans the whole key sequence
(`kv_indices.size(-1) * KV_BLOCK_SIZE >= KV_LEN`, torch/_inductor/kernel/flex/flex_cpu.py), so on the
CPU the partial indices are (T, num_pool_blocks), zero past each row's K: tiles times pool blocks
int32s per step, a cost only the CPU pays (its pools are the CPU budget's size).

On CUDA the tiles must suit Triton's kernel (torch/_inductor/kernel/flex/flex_attention.py): its
BLOCK_M and BLOCK_N must divide the mask's query and key tiles, and `tl.dot` needs 16 or more of
each. Inductor's default tile is 64 x 64 or larger, whose BLOCK_N does not divide a 16-token pool
block, and with its one default config it raises "Q and KV block size must be divisible by BLOCK_M and
BLOCK_N". So on CUDA a pool block is a multiple of 16 tokens, a query tile is 16 tokens or a multiple
(a decode is padded to one tile of 16, its padding repeating its token: the keys are read once either
way, only the tensor cores' rows are wasted), and `kernel_options` name BLOCK_N = 16 and BLOCK_M = the
largest power of two up to 64 that divides the tile's rows (vLLM's flex backend names 16 x 16 over its
16-token blocks the same way). `FORCE_USE_FLEX_ATTENTION` keeps the main kernel: for short queries
inductor would pick its decoding kernel, which has a tile rule of its own. PyTorch tests these kernels
on sm80+ only, and so this backend refuses older GPUs. The CUDA path has not yet run on a GPU where
this was written (the GPU-marked test in tests/attention/test_flex_attention.py is what to run).
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..device import device_profile
from .backend import AttentionBackend
from .metadata import AttentionMetadata

try:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError as _error:  # torch < 2.5
    BlockMask = flex_attention = None  # type: ignore[assignment,misc]
    _TORCH_REASON: str | None = f"torch.nn.attention.flex_attention cannot be imported ({_error})"
else:
    _TORCH_REASON = None
    if "compute_q_blocks" not in inspect.signature(BlockMask.from_kv_blocks).parameters:  # torch < 2.9
        _TORCH_REASON = "this torch's BlockMask.from_kv_blocks has no compute_q_blocks (torch 2.9 or newer)"

_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what inductor's CPU template supports
_CUDA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # Triton's dot: no float64
CUDA_MIN_CAPABILITY = (8, 0)  # what PyTorch's own flex tests require (test/inductor/test_flex_attention.py)
CUDA_TILE = 16  # tl.dot's smallest tile: on CUDA a query tile's tokens and a pool block are multiples of it
_CUDA_MAX_BLOCK_M = 64  # with BLOCK_N = 16, shared memory stays under inductor's default 64 x 64 tile's


def cuda_unavailable_reason(capability: tuple[int, int], dtype: torch.dtype) -> str | None:
    """None when flex's Triton kernels run on a GPU of compute `capability` in `dtype`; else why not (a pure
    function of the two, so that a CPU test can ask about a T4)."""
    if tuple(capability) < CUDA_MIN_CAPABILITY:
        major, minor = capability
        return (f"FlexAttention's Triton kernels are built and tested for compute capability 8.0 or newer "
                f"(this GPU is {major}.{minor}; a T4 is 7.5)")
    if dtype not in _CUDA_DTYPES:
        return f"FlexAttention's Triton kernels run in float16, bfloat16 or float32, not {dtype}"
    return None


def cuda_block_size_reason(block_size: int) -> str | None:
    """None when pool blocks of `block_size` tokens suit the Triton kernel, whose BLOCK_N (16 at least)
    must divide a block; else why not."""
    if block_size % CUDA_TILE:
        return (f"on CUDA flex needs block_size a multiple of {CUDA_TILE} (Triton's BLOCK_N divides a pool "
                f"block and is at least {CUDA_TILE}), not {block_size}")
    return None


def cuda_tile_tokens_reason(tile_tokens: int) -> str | None:
    """None when query tiles of `tile_tokens` tokens suit the Triton kernel: their rows (tokens times the
    GQA group) must be a multiple of BLOCK_M, 16 at least, whatever the group; else why not."""
    if tile_tokens % CUDA_TILE:
        return f"on CUDA flex needs query tiles of a multiple of {CUDA_TILE} tokens, not {tile_tokens}"
    return None


def cuda_kernel_options(tile_rows: int) -> dict[str, int | bool]:
    """Triton tiles for query tiles of `tile_rows` rows (a multiple of 16) over 16-token key tiles."""
    block_m = tile_rows & -tile_rows  # the largest power of two that divides tile_rows
    return {"BLOCK_M": min(block_m, _CUDA_MAX_BLOCK_M), "BLOCK_N": CUDA_TILE, "FORCE_USE_FLEX_ATTENTION": True}


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
    kernel_options: dict[str, int | bool] | None = None,
) -> torch.Tensor:
    """query (1, KV, M * group, d) over keys, values (1, KV, num_blocks * block_size, d) -> like query.

    Tile t (tile_tokens tokens, tile_tokens * group rows) sees blocks full_indices[t, :full_count[t]]
    whole and partial_indices[t, :partial_count[t]] through `paged_causal_mask`; index rows are as
    wide as the pool for the CPU's partial indices (its template checks it), else compact
    (`FlexPart.block_indices`).
    The block mask is built here, inside the compiled region, so that its sizes are the tensors'
    dynamic sizes, not Python ints the compiler would specialize on. (The four block-mask tensors must
    be distinct buffers: inductor's CPU template names its pointers by buffer.)
    """
    block_mask = BlockMask.from_kv_blocks(
        partial_count[None, None], partial_indices[None, None],  # (1, 1, T), (1, 1, T, K or num_blocks)
        full_count[None, None], full_indices[None, None],  # (1, 1, T), (1, 1, T, max(2, W))
        BLOCK_SIZE=(tile_tokens * group, block_size),
        mask_mod=paged_causal_mask(positions, partial_blocks, tile_tokens, group, block_size),
        seq_lengths=(query.shape[2], keys.shape[2]),
        compute_q_blocks=False,
    )
    return flex_attention(query, keys, values, block_mask=block_mask, kernel_options=kernel_options)


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
    indices: dict[tuple[int, bool], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def block_indices(self, num_pool_blocks: int, pool_wide: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(partial, full) block indices, built at the first layer and kept for the others. Kernels read the
        first partial_count[t] / full_count[t] entries of row t: (T, K) and (T, max(2, W)), W the widest
        block table (2 at least: the compiler specializes a size of 1). `pool_wide`: the partial ones
        (T, num_pool_blocks), zero-filled past each row's K, as inductor's CPU template asserts."""
        key = (num_pool_blocks, pool_wide)
        pair = self.indices.get(key)
        if pair is None:
            num_tiles, width = self.tables.shape
            if width > num_pool_blocks:
                raise ValueError(f"block tables {width} blocks wide, pool of {num_pool_blocks}")
            partial_blocks = self.partial_blocks[:, 1:].clamp(min=0)  # (T, K), a new buffer
            if pool_wide:
                partial = torch.zeros(num_tiles, num_pool_blocks, dtype=torch.int32, device=self.tables.device)
                partial[:, : partial_blocks.shape[1]] = partial_blocks
            else:
                partial = partial_blocks
            full = torch.zeros(num_tiles, max(2, width), dtype=torch.int32, device=self.tables.device)
            full[:, :width] = self.tables
            pair = self.indices[key] = (partial, full)
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
    `decode_tile_tokens`: by default 1 on the CPU (a decode's own token; a tile's tokens times the GQA
    group are the kernel's GEMM rows) and CUDA_TILE on CUDA, where Triton's kernel wants tiles of 16
    tokens or a multiple (`cuda_tile_tokens_reason`).
    """

    name = "flex"
    reads_whole_pool = True  # compiled for the pool's size (a quantized pool is read back whole)

    def __init__(self, prefill_tile_tokens: int = 16, decode_tile_tokens: int | None = None) -> None:
        if prefill_tile_tokens < 1 or (decode_tile_tokens is not None and decode_tile_tokens < 1):
            raise ValueError("prefill_tile_tokens and decode_tile_tokens must be >= 1")
        self.prefill_tile_tokens = prefill_tile_tokens
        self.decode_tile_tokens = decode_tile_tokens  # None: 1 on the CPU, CUDA_TILE on CUDA
        self._compiled: Callable[..., torch.Tensor] | None = None  # compiled at the first forward

    @classmethod
    def is_available(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        if _TORCH_REASON is not None:
            return _TORCH_REASON
        if device.type == "cpu":
            profile = device_profile(device)
            if profile.emulated and (reason := cuda_unavailable_reason(profile.capability, dtype)) is not None:
                return reason  # the CPU playing a T4: where flex would not run on that GPU, it does not run here
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

            if not has_triton():
                return "Triton cannot compile for this GPU (torch.utils._triton.has_triton() is False)"
            return cuda_unavailable_reason(torch.cuda.get_device_capability(device), dtype)
        return f"no FlexAttention kernel for device type {device.type!r}"

    @classmethod
    def supports_block_size_on(cls, device: torch.device, block_size: int) -> str | None:
        """None when pools of `block_size`-token blocks can be read on `device`; else why not. The CPU's
        template takes any block; Triton's tiles need multiples of 16 (the selector asks this too)."""
        return cuda_block_size_reason(block_size) if device.type == "cuda" else cls.supports_block_size(block_size)

    def tile_tokens(self, device: torch.device) -> tuple[int, int]:
        """(prefill, decode) tokens per query tile on `device`; ValueError where CUDA cannot run them."""
        decode = self.decode_tile_tokens or (CUDA_TILE if device.type == "cuda" else 1)
        if device.type == "cuda":
            reason = cuda_tile_tokens_reason(self.prefill_tile_tokens) or cuda_tile_tokens_reason(decode)
            if reason is not None:
                raise ValueError(reason)
        return self.prefill_tile_tokens, decode

    def plan(self, metadata: AttentionMetadata) -> FlexPlan:
        device = metadata.block_tables.device
        reason = self.supports_block_size_on(device, metadata.block_size)
        if reason is not None:
            raise ValueError(reason)
        prefill_tile, decode_tile = self.tile_tokens(device)
        decodes = metadata.decode_rows
        prefills = [b for b, count in enumerate(metadata.query_lens_host) if count > 1]
        return FlexPlan(build_part(metadata, decodes, decode_tile) if decodes else None,
                        build_part(metadata, prefills, prefill_tile) if prefills else None)

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
        on_cuda = keys.device.type == "cuda"
        partial, full = part.block_indices(keys.shape[2] // block_size, pool_wide=not on_cuda)
        tensors = (part.positions, part.partial_blocks, part.partial_count, partial, part.full_count, full)
        torch._dynamo.mark_dynamic(q, 2)
        for tensor in tensors:
            torch._dynamo.mark_dynamic(tensor, 0)
        torch._dynamo.mark_dynamic(full, 1)  # the step's widest block table (the CPU's partial rows: the pool)
        options = cuda_kernel_options(part.tile_tokens * group) if on_cuda else None
        result = self._compiled(q, keys, values, *tensors, part.tile_tokens, group, block_size,
                                options)  # (1, KV, M * G, d)
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
