"""This package's C kernels for quantized weights on the CPU (`csrc/quantized_matmul.c`), called with ctypes.

Three things PyTorch's own quantized kernels do not do well here (the C file has the measurements):

- **int4 at many rows.** `torch._weight_int4pack_mm_for_cpu` is made for a few rows: at 64 rows and more
  a dense bfloat16 product beats it by up to 3x (and in float32 it is slow at any size).
  `int4_dequantize_t` turns a layer's packed weight back into W^T in the compute dtype, reading PyTorch's
  own packing, so no second copy of the weight is kept, and the dense product does the rest.
  The packing is PyTorch's internal layout: `int4_layout_matches` checks it against PyTorch's packer on
  first use, and the layers keep PyTorch's kernel where it differs.
- **the Q8_0 table.** PyTorch's int8 kernel takes one scale per output row, and Q8_0 has one per 32
  columns: `q8_matmul` reads the block-major table (`quantized_embedding.py`) with its scales in one
  pass, and `q8_dequantize` turns a tile of its rows back into the compute dtype.
- **int4 at a few rows, in bfloat16.** Even there PyTorch's kernel spends more time turning 4-bit values
  into floats than multiplying them. `int4_matmul` multiplies them as 16-bit integers (AVX-512 VNNI), the
  activations turned into 16-bit integers per group with a power-of-two step, reading PyTorch's packing:
  1.3x PyTorch's kernel over the bundled model's layers at one row, 1.5-1.9x at 32 rows (the C file has
  the numbers and the error bound). It returns None where it does not apply (float32, a tail of rows
  short of a block of 64, a CPU or build without VNNI), and the caller keeps PyTorch's kernel.

The library is built on first use and cached (`native/build.py`); without a C compiler, `kernels_unavailable_reason`
says why and the layers keep PyTorch's kernels.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from ..native import FLAG_SETS, KernelUnavailable, build_library

SOURCE_DIR = Path(__file__).parent / "csrc"
SOURCES = ("quantized_matmul.c",)
SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_P, _I = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = {
    "int4_dequantize_t": [_P, _P, _I, _I, _I, _P],  # packed, scales_and_zeros, N, K, group, out
    "q8_matmul": [_P, _I, _I, _P, _P, _P, _I, _I, _P],  # x, x_stride, M, q, d, mins (or NULL), V, blocks, out
    "q8_dequantize": [_P, _P, _P, _I, _I, _I, _I, _P],  # q, d, mins (or NULL), V, blocks, v0, v1, out
}


# x, x_stride, M, packed, scales_and_zeros, N, K, group, out: bfloat16 only
_INT4_MATMUL_ARGTYPES = [_P, _I, _I, _P, _P, _I, _I, _I, _P]


@functools.cache
def load_library() -> ctypes.CDLL:
    """The compiled library (built on first call, then cached on disk and in this process)."""
    library = build_library("quantized_matmul", SOURCE_DIR, SOURCES, SOURCES, FLAG_SETS)
    functions = [(getattr(library, f"{name}_{suffix}"), argtypes)
                 for name, argtypes in _ARGTYPES.items() for suffix in SUFFIX.values()]
    for function, argtypes in [*functions, (library.int4_matmul_bf16, _INT4_MATMUL_ARGTYPES)]:
        function.restype = ctypes.c_int
        function.argtypes = argtypes
    return library


@functools.cache
def kernels_unavailable_reason() -> str | None:
    """None when the kernels build here and read PyTorch's int4 packing as it is; otherwise why not."""
    try:
        load_library()
    except KernelUnavailable as error:
        return str(error)
    if not int4_layout_matches():
        return f"PyTorch {torch.__version__} packs int4 weights in a layout this kernel does not read"
    return None


def _function(name: str, dtype: torch.dtype):
    if dtype not in SUFFIX:
        raise TypeError(f"the quantized C kernels compute in {', '.join(map(str, SUFFIX))}, got {dtype}")
    return getattr(load_library(), f"{name}_{SUFFIX[dtype]}")


def _check_cpu_contiguous(**tensors: torch.Tensor) -> None:
    for name, tensor in tensors.items():
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(f"{name} must be a contiguous CPU tensor, got {tuple(tensor.shape)} on {tensor.device}")


def int4_dequantize_t(packed: torch.Tensor, scales_and_zeros: torch.Tensor, in_features: int,
                      group_size: int) -> torch.Tensor:
    """W^T (in_features, N) in scales_and_zeros' dtype, from PyTorch's CPU int4 packing: packed (N, K / 2)
    uint8 from `torch._convert_weight_to_int4pack_for_cpu`, scales_and_zeros (K / group, N, 2)."""
    num_rows = packed.shape[0]
    if packed.dtype != torch.uint8 or packed.shape != (num_rows, in_features // 2) or num_rows % 2:
        raise ValueError(f"packed must be uint8 ({num_rows}, {in_features // 2}) with an even row count, "
                         f"got {packed.dtype} {tuple(packed.shape)}")
    if scales_and_zeros.shape != (in_features // group_size, num_rows, 2) or in_features % group_size:
        raise ValueError(f"scales_and_zeros must be {(in_features // group_size, num_rows, 2)}, "
                         f"got {tuple(scales_and_zeros.shape)}")
    _check_cpu_contiguous(packed=packed, scales_and_zeros=scales_and_zeros)
    out = torch.empty(in_features, num_rows, dtype=scales_and_zeros.dtype)  # (K, N)
    status = _function("int4_dequantize_t", out.dtype)(packed.data_ptr(), scales_and_zeros.data_ptr(), num_rows,
                                                         in_features, group_size, out.data_ptr())
    if status != 0:
        raise ValueError(f"the int4 kernel refused K={in_features}, group {group_size} (a multiple of 32 dividing K)")
    return out


def int4_matmul(rows: torch.Tensor, packed: torch.Tensor, group_size: int,
                scales_and_zeros: torch.Tensor) -> torch.Tensor | None:
    """rows (M, K) @ W^T -> (M, N) in bfloat16 for a weight in PyTorch's CPU int4 packing (as
    `int4_dequantize_t`), by this package's 16-bit integer kernel; None where it does not apply (rows or
    scales not bfloat16, N not a multiple of 64, a group size it does not take, an infinity or a NaN in
    rows, a build without AVX-512 VNNI): then PyTorch's kernel is the one to call."""
    num_rows, in_features = rows.shape
    if rows.dtype != torch.bfloat16 or scales_and_zeros.dtype != torch.bfloat16 or rows.stride(1) != 1:
        return None
    expected = (in_features // group_size, packed.shape[0], 2) if group_size > 0 else None
    if (packed.dtype != torch.uint8 or packed.shape != (packed.shape[0], in_features // 2)
            or scales_and_zeros.shape != expected or in_features % group_size):
        raise ValueError(f"packed uint8 (N, {in_features // 2}) and scales_and_zeros (K / group, N, 2) must match rows "
                         f"(M, {in_features}) and group {group_size}, got {tuple(packed.shape)} and "
                         f"{tuple(scales_and_zeros.shape)}")
    if rows.device.type != "cpu":
        raise ValueError(f"rows must be on the CPU, got {rows.device}")
    _check_cpu_contiguous(packed=packed, scales_and_zeros=scales_and_zeros)
    out = torch.empty(num_rows, packed.shape[0], dtype=torch.bfloat16)  # (M, N)
    status = load_library().int4_matmul_bf16(rows.data_ptr(), rows.stride(0), num_rows, packed.data_ptr(),
                                             scales_and_zeros.data_ptr(), packed.shape[0], in_features, group_size,
                                             out.data_ptr())
    return out if status == 0 else None


def q8_matmul(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) @ W^T -> (M, V) in x's dtype, W a block-major Q8_0 table: q (K / 32, V, 32) int8, d (K / 32, V)
    in x's dtype, W[v, 32 b + j] = q[b, v, j] * d[b, v] (+ m[b, v], a minimum like d, when given)."""
    blocks, vocab, _ = q.shape
    if q.dtype != torch.int8 or q.shape[2] != 32 or d.shape != (blocks, vocab) or d.dtype != x.dtype:
        raise ValueError(f"q must be int8 (blocks, V, 32) and d (blocks, V) in {x.dtype}, "
                         f"got {q.dtype} {tuple(q.shape)} and {d.dtype} {tuple(d.shape)}")
    if x.dim() != 2 or x.shape[1] != blocks * 32 or x.stride(1) != 1:
        raise ValueError(f"x must be (M, {blocks * 32}) with contiguous rows, got {tuple(x.shape)}")
    _check_cpu_contiguous(q=q, d=d)
    mins = _checked_mins(m, d)
    out = torch.empty(x.shape[0], vocab, dtype=x.dtype)
    if x.shape[0] and _function("q8_matmul", x.dtype)(x.data_ptr(), x.stride(0), x.shape[0], q.data_ptr(),
                                                       d.data_ptr(), mins, vocab, blocks, out.data_ptr()) != 0:
        raise RuntimeError("the Q8_0 kernel failed")
    return out


def q8_dequantize(q: torch.Tensor, d: torch.Tensor, start: int, stop: int,
                  m: torch.Tensor | None = None) -> torch.Tensor:
    """Rows start .. stop - 1 of a block-major Q8_0 table (as `q8_matmul`, with its minimum m if any) in d's
    dtype: (stop - start, K)."""
    blocks, vocab, _ = q.shape
    if not 0 <= start <= stop <= vocab:
        raise ValueError(f"rows {start}..{stop} are outside a table of {vocab}")
    _check_cpu_contiguous(q=q, d=d)
    mins = _checked_mins(m, d)
    out = torch.empty(stop - start, blocks * 32, dtype=d.dtype)
    if _function("q8_dequantize", d.dtype)(q.data_ptr(), d.data_ptr(), mins, vocab, blocks, start, stop,
                                           out.data_ptr()) != 0:
        raise RuntimeError("the Q8_0 kernel failed")
    return out


def _checked_mins(m: torch.Tensor | None, d: torch.Tensor) -> int | None:
    """A table's minimum (shaped and typed as its scales d) as a pointer for the C code, or None."""
    if m is None:
        return None
    if m.shape != d.shape or m.dtype != d.dtype:
        raise ValueError(f"the minimum must be {tuple(d.shape)} in {d.dtype}, got {m.dtype} {tuple(m.shape)}")
    _check_cpu_contiguous(m=m)
    return m.data_ptr()


def int4_layout_matches() -> bool:
    """Whether PyTorch packs int4 weights as the C kernel reads them: a small weight with a full block of
    64 rows and a tail of 16, packed by PyTorch and read back here, exactly."""
    rows, columns, group = 80, 64, 32
    q = (torch.arange(rows * columns, dtype=torch.int32).reshape(rows, columns) * 7) % 16  # (N, K) in 0..15
    scale = torch.arange(1, 1 + rows * columns // group, dtype=torch.float32).reshape(rows, -1) / 64  # (N, G)
    zero = -scale / 2
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    scales_and_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()  # (G, N, 2)
    expected = (q - 8) * scale.repeat_interleave(group, dim=1) + zero.repeat_interleave(group, dim=1)  # (N, K)
    try:
        read = int4_dequantize_t(packed, scales_and_zeros, columns, group)
    except ValueError:
        return False
    return torch.equal(read.t(), expected)
