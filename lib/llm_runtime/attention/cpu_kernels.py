"""This package's C kernels for paged attention on the CPU: compiled on first use, called with ctypes.

PyTorch has no CPU operator that reads keys where they lie in a paged pool, so the `cpu` backend
brings its own: `csrc/paged_decode.c` (attention, plain C with OpenMP; the file explains the
algorithm) and `csrc/store_kv.c` (the step's keys and values into the pool). Attention reads a pool
in the query's dtype (`paged_decode`) or an 8-bit one as stored, int8 (keys scaled and turned to their
positions in the kernel, the values' scales folded into the output) or float8 e4m3fn
(`paged_decode_quantized`, kv_quant.py): one C function per pair of dtypes. The
library is built on first use and cached (`native/build.py`), and loaded with ctypes. PyTorch tensors are
passed as raw pointers, so the wrapper checks every dtype, layout and shape the C code assumes.

`cpu_paged_attention` is both calls as one PyTorch operator, a layer's whole attention, for the engine's
compiled forward pass (worker/compiled_forward.py): the tracer cannot see into a ctypes call, but it keeps
an operator as one node of its graph.

Without a working C compiler (or on a platform where none of the flag sets below builds),
`load_library` raises `KernelUnavailable` with the compiler's message, and the engine picks the
block-wise backend instead.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from .kv_quant import ChannelScale, KeyTurns, QuantizedPools
from ..native import FLAG_SETS, KernelUnavailable, build_library
from ..native.operators import define_operator  # noqa: F401 (tests set FLAG_SETS here)

SOURCE_DIR = Path(__file__).parent / "csrc"
SOURCES = ("paged_decode.c", "paged_decode_body.h", "store_kv.c")
COMPILED = ("paged_decode.c", "store_kv.c")  # one library from these
KERNEL_DTYPES = {torch.float32: "paged_decode_f32", torch.bfloat16: "paged_decode_bf16"}
# (query dtype, pool dtype) -> the kernel that reads that 8-bit pool as stored.
QUANTIZED_KERNELS = {
    (torch.float32, torch.int8): "paged_decode_f32_i8",
    (torch.bfloat16, torch.int8): "paged_decode_bf16_i8",
    (torch.float32, torch.float8_e4m3fn): "paged_decode_f32_fp8",
    (torch.bfloat16, torch.float8_e4m3fn): "paged_decode_bf16_fp8",
}
TURNED_KEY_KERNELS = ("paged_decode_f32_i8", "paged_decode_bf16_i8")
STORE_INT8 = {torch.float32: "store_kv_int8_f32", torch.bfloat16: "store_kv_int8_bf16"}  # keys' dtype -> C store
SCALED_POOL_DTYPES = (torch.int8,)  # pools read with a ChannelScale, keys turned back (kv_quant.py)


@functools.cache
def load_library() -> ctypes.CDLL:
    """The compiled kernel library (built on first call, then cached on disk and in this process)."""
    library = build_library("paged_decode", SOURCE_DIR, SOURCES, COMPILED, FLAG_SETS)
    for symbol in (*KERNEL_DTYPES.values(), *QUANTIZED_KERNELS.values()):
        function = getattr(library, symbol)
        function.restype = ctypes.c_int
        function.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,  # query, strides
                             ctypes.c_void_p, ctypes.c_void_p,  # key_pool, value_pool
                             ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,  # tables, stride, seq_lens
                             ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,  # rows, num_seqs, out
                             ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float]
        if symbol in TURNED_KEY_KERNELS:  # the keys' and values' scales and zeros, the angles' cosines and sines
            function.argtypes += [ctypes.c_void_p] * 6
    for symbol in STORE_INT8.values():
        function = getattr(library, symbol)
        function.restype = ctypes.c_int
        function.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,  # key, strides
                             ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,  # value, strides
                             ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,  # slot_mapping, positions, num_rows
                             ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,  # pools, num_slots
                             ctypes.c_int, ctypes.c_int,  # num_kv_heads, head_dim
                             *[ctypes.c_void_p] * 6,  # the scales and zeros, the angles' cosines and sines
                             ctypes.c_int64]  # num_positions
    library.store_kv.restype = ctypes.c_int
    library.store_kv.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,  # key, strides
                                 ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,  # value, strides
                                 ctypes.c_void_p, ctypes.c_int64,  # slot_mapping, num_rows
                                 ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,  # pools, num_slots
                                 ctypes.c_int, ctypes.c_int64]  # num_kv_heads, head_bytes
    return library


def kernel_unavailable_reason() -> str | None:
    """None when the kernel builds and loads here; otherwise why not."""
    try:
        load_library()
    except KernelUnavailable as error:
        return str(error)
    return None


def paged_decode(
    query: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    rows: torch.Tensor,
    out: torch.Tensor,
    *,
    indices_checked: bool = False,
) -> None:
    """Write into out[rows[b]] (num_heads, d) the attention of query[rows[b]] over the first seq_lens[b]
    keys of the blocks block_tables[b], for every b: each entry a query row that sees a prefix of its
    sequence (a decode, or one row of a prefill chunk).

    query (N, H, d) with its last dimension contiguous; key_pool, value_pool (num_blocks, block_size,
    KV, d) contiguous; block_tables (B, max_blocks) int32 contiguous; seq_lens (B,) int32; rows (B,)
    int64; out (N, H, d) contiguous. All on the CPU, query, pools and out of one dtype in KERNEL_DTYPES.
    The C code trusts the indices, so they are checked here (`check_indices`) unless the caller has
    already checked these same tensors (`indices_checked=True`: once per step, not once per layer).
    """
    dtype = query.dtype
    if dtype not in KERNEL_DTYPES or not (key_pool.dtype == value_pool.dtype == out.dtype == dtype):
        raise TypeError(f"the C kernel takes {', '.join(map(str, KERNEL_DTYPES))} throughout, "
                        f"got query {dtype}, pools {key_pool.dtype}/{value_pool.dtype}, out {out.dtype}")
    _paged_decode(KERNEL_DTYPES[dtype], query, key_pool, value_pool, block_tables, seq_lens, rows, out,
                  indices_checked)


def paged_decode_quantized(
    query: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    key_scale: ChannelScale | None,
    value_scale: ChannelScale | None,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    rows: torch.Tensor,
    out: torch.Tensor,
    *,
    indices_checked: bool = False,
    key_turns: KeyTurns | None = None,
) -> None:
    """`paged_decode` over 8-bit pools as stored (kv_quant.py), converted to float32 in the kernel's
    registers: no full-precision copy of any block.

    query and out float32 or bfloat16 (one dtype); key_pool, value_pool (num_blocks, block_size, KV, d)
    contiguous, both int8 or both float8_e4m3fn; for int8, the layer's key_scale and value_scale and the
    model's `key_turns`, for float8 all None. The rest as `paged_decode`.

    An int8 element stands for q * s + z, s and z per KV head and channel. Keys were stored turned back by
    the rotary embedding, so the kernel scales each chunk of them and turns it to its positions (a table
    of angles as long as the longest row) before the dot products. The output is a weighted mean of the
    values (the weights sum to one), so the kernel writes (mean of stored values) * s_v + z_v.
    """
    symbol = QUANTIZED_KERNELS.get((query.dtype, key_pool.dtype))
    if symbol is None or value_pool.dtype != key_pool.dtype or out.dtype != query.dtype:
        pairs = ", ".join(f"{q} over {p}" for q, p in QUANTIZED_KERNELS)
        raise TypeError(f"the quantized C kernel reads {pairs} (out in the query's dtype), got query "
                        f"{query.dtype}, pools {key_pool.dtype}/{value_pool.dtype}, out {out.dtype}")
    if key_pool.dtype not in SCALED_POOL_DTYPES:
        if key_scale is not None or value_scale is not None or key_turns is not None:
            raise ValueError(f"a {key_pool.dtype} pool has no scales and keys as the model turned them")
        _paged_decode(symbol, query, key_pool, value_pool, block_tables, seq_lens, rows, out, indices_checked)
        return
    if key_scale is None or value_scale is None or key_turns is None:
        raise ValueError(f"a {key_pool.dtype} pool needs its key and value scales and the model's key_turns")
    num_heads, (_, _, num_kv_heads, head_dim) = query.shape[1], key_pool.shape
    for scale in (key_scale, value_scale):
        if scale.scale.shape != (num_kv_heads, head_dim) or scale.zero.shape != (num_kv_heads, head_dim):
            raise ValueError(f"scales must be ({num_kv_heads}, {head_dim}) per KV head and channel, "
                             f"got {tuple(scale.scale.shape)} and {tuple(scale.zero.shape)}")
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not share {num_kv_heads} KV heads evenly")
    if key_turns.inv_freq.shape != (head_dim // 2,):
        raise ValueError(f"key_turns for heads of {2 * key_turns.inv_freq.shape[0]}, pools of {head_dim}")
    cos, sin = key_turns.tables(int(seq_lens.max()) if seq_lens.numel() else 0)  # (P, d/2) each
    _paged_decode(symbol, query, key_pool, value_pool, block_tables, seq_lens, rows, out, indices_checked,
                  (*_scale_tables(key_scale, value_scale), cos, sin))


def _scale_tables(key_scale: ChannelScale, value_scale: ChannelScale) -> list[torch.Tensor]:
    """An int8 pool's scales and zeros as the C code reads them: key scale, key zero, value scale, value zero,
    each (KV, d) float32 and contiguous."""
    return [t.float().contiguous() for t in (key_scale.scale, key_scale.zero, value_scale.scale, value_scale.zero)]


def _paged_decode(symbol: str, query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor,
                  block_tables: torch.Tensor, seq_lens: torch.Tensor, rows: torch.Tensor, out: torch.Tensor,
                  indices_checked: bool, key_extras: tuple[torch.Tensor, ...] = ()) -> None:
    """The checks every variant shares (devices, layouts, shapes, indices), then the C call `symbol`
    (dtypes already checked by the caller; `key_extras` checked there too)."""
    _check_decode_inputs(query, key_pool, value_pool, block_tables, seq_lens, rows, out)
    if rows.shape[0] == 0:
        return
    if not indices_checked:
        check_indices(block_tables, seq_lens, rows, num_rows=query.shape[0], num_blocks=key_pool.shape[0],
                      block_size=key_pool.shape[1])
    _call_paged_decode(symbol, query, key_pool, value_pool, block_tables, seq_lens, rows, out, key_extras)


def _check_decode_inputs(query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, rows: torch.Tensor,
                         out: torch.Tensor | None) -> None:
    """What the C attention assumes of its tensors, short of the indices' values (`check_indices`): the CPU,
    the index tensors' dtypes (read through int32 and int64 pointers), every shape and layout. The C code is
    handed raw pointers, so a tensor that is not what it assumes would be read past its end. `out`: None
    where the caller allocates it."""
    tensors = (query, key_pool, value_pool, block_tables, seq_lens, rows, *(() if out is None else (out,)))
    if any(t.device.type != "cpu" for t in tensors):
        raise ValueError("the C kernel runs on CPU tensors only")
    if not (key_pool.is_contiguous() and value_pool.is_contiguous() and (out is None or out.is_contiguous())
            and block_tables.is_contiguous() and seq_lens.is_contiguous() and rows.is_contiguous()):
        raise ValueError("pools, out, block_tables, seq_lens and rows must be contiguous")
    if query.stride(-1) != 1:
        raise ValueError("query's last dimension must be contiguous")
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32 or rows.dtype != torch.int64:
        raise TypeError(f"block_tables and seq_lens are int32, rows int64; got {block_tables.dtype}, "
                        f"{seq_lens.dtype}, {rows.dtype}")
    if (query.dim() != 3 or key_pool.dim() != 4 or block_tables.dim() != 2 or seq_lens.dim() != 1
            or rows.dim() != 1):
        raise ValueError(f"shapes disagree: query {tuple(query.shape)} (N, H, d), pools {tuple(key_pool.shape)} "
                         f"(blocks, block_size, KV, d), block_tables {tuple(block_tables.shape)} (B, max_blocks), "
                         f"seq_lens {tuple(seq_lens.shape)} (B,), rows {tuple(rows.shape)} (B,)")
    num_seqs = rows.shape[0]
    if block_tables.shape[0] != num_seqs or seq_lens.shape[0] != num_seqs:
        raise ValueError(f"shapes disagree: {num_seqs} rows but {block_tables.shape[0]} block tables, "
                         f"{seq_lens.shape[0]} lengths")
    if (out is not None and out.shape != query.shape) or key_pool.shape[3] != query.shape[2] \
            or value_pool.shape != key_pool.shape:
        out_shape = None if out is None else tuple(out.shape)
        raise ValueError(f"shapes disagree: query {tuple(query.shape)}, out {out_shape}, "
                         f"pools {tuple(key_pool.shape)} / {tuple(value_pool.shape)}")


def _call_paged_decode(symbol: str, query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor,
                       block_tables: torch.Tensor, seq_lens: torch.Tensor, rows: torch.Tensor,
                       out: torch.Tensor, key_extras: tuple[torch.Tensor, ...] = ()) -> None:
    """The C call `symbol` over tensors already checked (an int8 pool's `key_extras`: the keys' and values'
    scales and zeros, the angles' cosines and sines, float32 and contiguous)."""
    _, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_pool.shape
    status = getattr(load_library(), symbol)(
        query.data_ptr(), query.stride(0), query.stride(1), key_pool.data_ptr(), value_pool.data_ptr(),
        block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(), rows.data_ptr(), rows.shape[0],
        out.data_ptr(), num_heads, num_kv_heads, head_dim, block_size, head_dim ** -0.5,
        *(t.data_ptr() for t in key_extras))
    if status != 0:
        raise ValueError(f"the C kernel does not handle {num_heads} heads over {num_kv_heads} KV heads "
                         f"of dim {head_dim} (at most 256 query heads, and heads x head dim at most 16384; "
                         f"an int8 pool's heads even and at most 256)")


def store_kv(key_pool: torch.Tensor, value_pool: torch.Tensor, slot_mapping: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor) -> None:
    """Write key, value (N, KV, d) at flat slots `slot_mapping` (N,) of the pools (num_blocks, block_size,
    KV, d); -1 writes nowhere. The same contract as `AttentionBackend.store_kv`, in one C call
    (csrc/store_kv.c). ValueError, with nothing written, if a slot lies outside the pool."""
    _check_store_inputs(key_pool, value_pool, slot_mapping, key, value)
    _call_store_kv(key_pool, value_pool, slot_mapping, key, value)


def _check_store_inputs(key_pool: torch.Tensor, value_pool: torch.Tensor, slot_mapping: torch.Tensor,
                        key: torch.Tensor, value: torch.Tensor) -> None:
    """What the C store assumes of its tensors (it checks the slots' values itself)."""
    if not (key.dtype == value.dtype == key_pool.dtype == value_pool.dtype):
        raise TypeError(f"key {key.dtype}, value {value.dtype} and pools {key_pool.dtype}/{value_pool.dtype} "
                        f"must share one dtype")
    if any(t.device.type != "cpu" for t in (key, value, key_pool, value_pool, slot_mapping)):
        raise ValueError("the C store runs on CPU tensors only")
    if not (key_pool.is_contiguous() and value_pool.is_contiguous() and slot_mapping.is_contiguous()):
        raise ValueError("pools and slot_mapping must be contiguous")
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("key's and value's last dimension must be contiguous")
    if slot_mapping.dtype != torch.int64:
        raise TypeError(f"slot_mapping is int64, got {slot_mapping.dtype}")
    if key.dim() != 3:
        raise ValueError(f"shapes disagree: key {tuple(key.shape)} is not (N, KV, d)")
    num_rows = key.shape[0]
    if value.shape != key.shape or key_pool.dim() != 4 or key_pool.shape[2:] != key.shape[1:] \
            or value_pool.shape != key_pool.shape or slot_mapping.shape != (num_rows,):
        raise ValueError(f"shapes disagree: key {tuple(key.shape)}, value {tuple(value.shape)}, pools "
                         f"{tuple(key_pool.shape)} / {tuple(value_pool.shape)}, slots {tuple(slot_mapping.shape)}")


def store_kv_int8(pools: QuantizedPools, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  positions: torch.Tensor) -> None:
    """`QuantizedPools.write` for an int8 pool, in one C call (csrc/store_kv.c): key, value (N, KV, d) float32 or
    bfloat16 at positions (N,) into flat slots `slot_mapping` (N,), keys turned back, every element rounded
    with its channel's scale; the same bytes as the Python path. ValueError, with nothing written, if a slot
    lies outside the pool."""
    symbol = STORE_INT8.get(key.dtype)
    if symbol is None or value.dtype != key.dtype or pools.key_pool.dtype != torch.int8 \
            or pools.value_pool.dtype != torch.int8:
        raise TypeError(f"the C int8 store takes float32 or bfloat16 keys and values into int8 pools, got {key.dtype}, "
                        f"{value.dtype} into {pools.key_pool.dtype}/{pools.value_pool.dtype}")
    turns, key_scale, value_scale = pools.key_turns, pools.key_scale, pools.value_scale
    if turns is None or key_scale is None or value_scale is None:
        raise ValueError("an int8 pool needs its key and value scales and the model's key_turns")
    tensors = (key, value, pools.key_pool, pools.value_pool, slot_mapping, positions)
    if any(t.device.type != "cpu" for t in tensors):
        raise ValueError("the C store runs on CPU tensors only")
    if not (pools.key_pool.is_contiguous() and pools.value_pool.is_contiguous() and slot_mapping.is_contiguous()
            and positions.is_contiguous()) or key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("pools, slot_mapping and positions must be contiguous, key's and value's last dimension too")
    if slot_mapping.dtype != torch.int64 or positions.dtype != torch.int64:
        raise TypeError(f"slot_mapping and positions are int64, got {slot_mapping.dtype} and {positions.dtype}")
    num_rows, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape or pools.key_pool.shape[2:] != key.shape[1:] \
            or pools.value_pool.shape != pools.key_pool.shape or slot_mapping.shape != (num_rows,) \
            or positions.shape != (num_rows,):
        raise ValueError(f"shapes disagree: key {tuple(key.shape)}, value {tuple(value.shape)}, pools "
                         f"{tuple(pools.key_pool.shape)}, slots {tuple(slot_mapping.shape)}, positions "
                         f"{tuple(positions.shape)}")
    for scale in (key_scale, value_scale):
        if scale.scale.shape != (num_kv_heads, head_dim) or scale.zero.shape != (num_kv_heads, head_dim):
            raise ValueError(f"scales must be ({num_kv_heads}, {head_dim}) per KV head and channel")
    if turns.inv_freq.shape != (head_dim // 2,):
        raise ValueError(f"key_turns for heads of {2 * turns.inv_freq.shape[0]}, pools of {head_dim}")
    cos, sin = turns.tables(int(positions.max()) + 1 if num_rows else 0)  # (P, d/2) each
    status = getattr(load_library(), symbol)(
        key.data_ptr(), key.stride(0), key.stride(1), value.data_ptr(), value.stride(0), value.stride(1),
        slot_mapping.data_ptr(), positions.data_ptr(), num_rows, pools.key_pool.data_ptr(),
        pools.value_pool.data_ptr(), pools.key_pool.shape[0] * pools.key_pool.shape[1], num_kv_heads, head_dim,
        *(t.data_ptr() for t in _scale_tables(key_scale, value_scale)), cos.data_ptr(), sin.data_ptr(), cos.shape[0])
    if status == 2:
        raise ValueError(f"the C int8 store turns pairs of channels: head_dim must be even, got {head_dim}")
    if status != 0:
        raise ValueError(f"a slot outside the pool of {pools.key_pool.shape[0] * pools.key_pool.shape[1]} slots, or a "
                         f"position outside 0 .. {cos.shape[0] - 1}: nothing written")


def _call_store_kv(key_pool: torch.Tensor, value_pool: torch.Tensor, slot_mapping: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor) -> None:
    """The C store over tensors already checked; it checks the slots itself."""
    size = key.element_size()
    num_slots = key_pool.shape[0] * key_pool.shape[1]
    status = load_library().store_kv(
        key.data_ptr(), key.stride(0) * size, key.stride(1) * size,
        value.data_ptr(), value.stride(0) * size, value.stride(1) * size,
        slot_mapping.data_ptr(), key.shape[0], key_pool.data_ptr(), value_pool.data_ptr(),
        num_slots, key.shape[1], key.shape[2] * size)
    if status != 0:
        raise ValueError(f"slot_mapping has a slot outside [-1, {num_slots})")


def _cpu_paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_pool: torch.Tensor,
                        value_pool: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                        seq_lens: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`store_kv` of this step's key, value (N, KV, d), then `paged_decode` of query (N, H, d) for every row of
    `rows`: out (N, H, d). One layer's attention as one operator, for a compiled forward pass.

    The operator is public (torch.ops.llm_runtime.cpu_paged_attention), so it checks everything the C code
    trusts, as `store_kv` and `paged_decode` do, before anything is written: dtypes, shapes, layouts and the
    indices (`check_indices`: a few reductions over the small index tensors, about 9 us a call on the 2-core
    CI machine; the C++ twin does it in a loop, native/csrc/operators.cpp)."""
    if not (query.dtype == key.dtype == value.dtype == key_pool.dtype == value_pool.dtype) or query.dtype not in KERNEL_DTYPES:
        raise TypeError(f"query, key, value and pools of one dtype in {', '.join(map(str, KERNEL_DTYPES))}")
    _check_store_inputs(key_pool, value_pool, slot_mapping, key, value)
    _check_decode_inputs(query, key_pool, value_pool, block_tables, seq_lens, rows, None)
    if key.shape[0] != query.shape[0]:
        raise ValueError(f"shapes disagree: {query.shape[0]} query rows but {key.shape[0]} keys")
    check_indices(block_tables, seq_lens, rows, num_rows=query.shape[0], num_blocks=key_pool.shape[0],
                  block_size=key_pool.shape[1])
    _call_store_kv(key_pool, value_pool, slot_mapping, key, value)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # (N, H, d), contiguous
    _call_paged_decode(KERNEL_DTYPES[query.dtype], query, key_pool, value_pool, block_tables, seq_lens, rows, out)
    return out


cpu_paged_attention = define_operator("cpu_paged_attention", _cpu_paged_attention,
                                      mutates_args=("key_pool", "value_pool"))


@torch.library.register_fake("llm_runtime::cpu_paged_attention")
def cpu_paged_attention_fake(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_pool: torch.Tensor,
                             value_pool: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                             seq_lens: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The output's shape and dtype, for tracing (also the C++ twin's, native/cpp_operators.py)."""
    return torch.empty(query.shape, dtype=query.dtype, device=query.device)


def check_indices(block_tables: torch.Tensor, seq_lens: torch.Tensor, rows: torch.Tensor, *, num_rows: int,
                  num_blocks: int, block_size: int) -> None:
    """ValueError unless every index the kernel will follow stays inside its tensor: rows in the batch,
    lengths within the table, table entries within the pool (the C code does no bounds checks)."""
    if rows.numel() == 0:
        return
    if int(rows.min()) < 0 or int(rows.max()) >= num_rows:
        raise ValueError(f"rows must lie in [0, {num_rows})")
    if int(seq_lens.min()) < 1 or int(seq_lens.max()) > block_tables.shape[1] * block_size:
        raise ValueError(f"seq_lens must lie in [1, {block_tables.shape[1] * block_size}] for tables of "
                         f"{block_tables.shape[1]} blocks of {block_size}")
    if block_tables.numel() and (int(block_tables.min()) < 0 or int(block_tables.max()) >= num_blocks):
        raise ValueError(f"block table entries must lie in [0, {num_blocks})")
