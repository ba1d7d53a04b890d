"""A batch-invariant RMSNorm in Triton, for CUDA (lesson 16): each row normalised by one program, alone.

PyTorch's CUDA reductions choose how to split a reduction from the whole tensor's shape: with few rows and long
ones, several thread blocks may share a row and add their partial sums afterwards, with many rows each block
takes whole rows. A row's sum of squares, and so its rounding, can then depend on the number of rows beside it.
Here one program owns one row: it loads the whole row (BLOCK, the row's length rounded up to a power of two),
sums the squares in float32 by one `tl.sum`, whose tree depends on BLOCK alone, and writes the row. Nothing
depends on the number of rows but the number of programs. The arithmetic is the reference's (pointwise.py):
normalise in float32, round to the input's dtype, multiply by the weight in that dtype.

On the CPU it runs under TRITON_INTERPRET=1 (set before triton is imported), in NumPy, which has no bfloat16:
the tiles are float32 there (`COMPUTE_FP32`), and the interpreter's float32 -> bfloat16 store truncates.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from .pointwise import PointwiseOps, rotary, silu_and_mul


@triton.jit
def rms_norm_kernel(
    x_ptr, w_ptr, y_ptr, stride_x, stride_y, N, eps,
    COMPUTE_FP32: tl.constexpr,  # the weight multiply in float32 (the CPU interpreter has no bfloat16)
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)  # (BLOCK,): the whole row
    ok = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)  # (BLOCK,)
    mean_square = tl.sum(x * x, axis=0) / N  # one reduction, its order fixed by BLOCK
    h = (x * tl.math.rsqrt(mean_square + eps)).to(y_ptr.dtype.element_ty)  # rounded as the reference rounds
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    if COMPUTE_FP32:
        y = h.to(tl.float32) * w.to(tl.float32)
    else:
        y = h * w
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=ok)


def invariant_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (..., N) / rms(x) * weight (N,), one program per row (module docstring)."""
    if x.shape[-1] != weight.shape[0]:
        raise ValueError(f"x has rows of {x.shape[-1]}, the weight {weight.shape[0]}")
    if x.device != weight.device:
        raise ValueError(f"x is on {x.device}, the weight on {weight.device}: the kernel reads one device")
    rows = x.reshape(-1, x.shape[-1])  # (..., N) -> (M, N); a copy only where x's rows are not contiguous
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    y = torch.empty_like(rows)
    if rows.shape[0]:
        with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
            rms_norm_kernel[(rows.shape[0],)](rows, weight, y, rows.stride(0), y.stride(0), rows.shape[1], eps,
                                              COMPUTE_FP32=not x.is_cuda, BLOCK=triton.next_power_of_2(rows.shape[1]))
    return y.reshape(x.shape)


# The layers' pointwise functions in the batch-invariant mode: RMSNorm by the kernel above; SiLU-and-multiply and
# rotary are elementwise, each output computed from its own inputs alone, invariant as they are.
INVARIANT_OPS = PointwiseOps("invariant", invariant_rms_norm, silu_and_mul, rotary)
