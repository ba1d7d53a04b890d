"""A batch-invariant matrix multiply in Triton, for CUDA (lesson 16): y = x W^T + b, each row reduced over the
inner dimension in one fixed order, whatever the number of rows and the row's place among them.

cuBLAS picks its kernel from the shape. For a few rows it may split the inner dimension K across thread blocks
and add their partial sums in a second pass (split-K), for many rows it takes larger tiles with other K steps:
either way the order in which a row's K products are summed, and so its rounding, depends on how many rows
came with it. Here nothing depends on M but the number of programs: each program computes a BLOCK_M x BLOCK_N
tile of the output, walking K from 0 upwards in steps of BLOCK_K with a float32 accumulator, never split, with
tile sizes that are constants, not tuned per shape. Row r's output is the same in a product of 1 row or of
2,048, at any place (tests/model/test_invariant_matmul.py checks it, under Triton's interpreter on the CPU and,
where there is one, on the GPU).

On the CPU the kernel runs under TRITON_INTERPRET=1 (set before triton is imported), in NumPy, which has no
bfloat16: tiles are cast to float32 first (`COMPUTE_FP32`), and the interpreter's float32 -> bfloat16 store
truncates instead of rounding. There `tl.dot` would be NumPy's matmul, whose CPU BLAS sums a tile's rows in
different orders by their place in the tile (measured: rows 6-15 of 16 apart from rows 0-5), so the
interpreter's step is a broadcast product summed by NumPy instead, the same for every row: the test checks the
tiling under the interpreter, and the GPU test the tensor cores. float32 inputs use IEEE products on the GPU
(`DOT_PRECISION`), not TF32.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from torch import nn

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 64  # fixed: the order of every row's sums depends on BLOCK_K alone


@triton.jit
def invariant_matmul_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
    HAS_BIAS: tl.constexpr,
    COMPUTE_FP32: tl.constexpr,  # cast tiles to float32 before the dot (the CPU interpreter)
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 inputs on the GPU, "tf32" (unused) for half precision
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    steps = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # the same steps, in the same order, for every row
        ks = k0 + steps
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk,
                    mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)  # (BLOCK_M, BLOCK_K)
        w = tl.load(w_ptr + cols[None, :] * stride_wn + ks[:, None] * stride_wk,
                    mask=(cols[None, :] < N) & (ks[:, None] < K), other=0.0)  # (BLOCK_K, BLOCK_N): W^T's tile
        if COMPUTE_FP32:  # the interpreter: products summed over the step by NumPy, the same way for every row
            acc += tl.sum(x.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], axis=1)
        else:  # the GPU: tensor-core products, each output's K sums in the instruction's fixed order
            acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn, acc.to(y_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) @ weight (N, K)^T + bias (N,) -> (..., N), batch-invariant (module docstring)."""
    if x.device != weight.device or (bias is not None and bias.device != weight.device):
        raise ValueError(f"x is on {x.device}, the weight on {weight.device}: the kernel reads one device")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} features, the weight takes {weight.shape[1]}")
    rows = x.reshape(-1, x.shape[-1])  # (..., K) -> (M, K)
    num_rows, (out_features, in_features) = rows.shape[0], weight.shape
    y = torch.empty(num_rows, out_features, dtype=x.dtype, device=x.device)
    if num_rows:
        grid = (triton.cdiv(num_rows, BLOCK_M), triton.cdiv(out_features, BLOCK_N))
        # A launch goes to the current CUDA device: make x's current (attention/triton_kernels.py says why).
        with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
            invariant_matmul_kernel[grid](
                rows, weight, bias if bias is not None else weight, y, num_rows, out_features, in_features,
                rows.stride(0), rows.stride(1), weight.stride(0), weight.stride(1), y.stride(0), y.stride(1),
                HAS_BIAS=bias is not None, COMPUTE_FP32=not x.is_cuda,
                DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return y.reshape(*x.shape[:-1], out_features)


class InvariantLinear(nn.Module):
    """An nn.Linear's y = x W^T + b through `invariant_linear`. It holds the linear's own parameters (a weight
    tied to the embedding stays tied), so the state dict is the linear's."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return invariant_linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def make_linears_invariant_(model: nn.Module) -> int:
    """Every nn.Linear of `model` replaced by an InvariantLinear over the same parameters (in place); returns how
    many."""
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear)]
    for parent, name, child in targets:
        setattr(parent, name, InvariantLinear(child))
    return len(targets)
