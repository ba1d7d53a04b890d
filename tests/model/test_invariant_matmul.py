"""The batch-invariant Triton matrix multiply (model/invariant_matmul.py): x W^T + b to rounding, and each row's
result bitwise the same in products of any number of rows, at any place. Without CUDA the kernel runs under
Triton's interpreter on small shapes (tests/conftest.py switches it on before triton is imported); it is also
compiled for a T4 and an H100 target, which needs no GPU; on a GPU it runs for real."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("TRITON_INTERPRET=1 must be set before triton is imported (tests/conftest.py does it)")
pytest.importorskip("triton")

from llm_runtime.model.invariant_matmul import BLOCK_M, invariant_linear

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _inputs(rows: int, k: int, n: int, dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=generator).to(DEVICE, dtype)
    weight = (torch.randn(n, k, generator=generator) / k**0.5).to(DEVICE, dtype)
    bias = torch.randn(n, generator=generator).to(DEVICE, dtype)
    return x, weight, bias


@pytest.mark.parametrize("rows, k, n", [(1, 64, 64), (5, 100, 70), (37, 200, 130)])
def test_it_multiplies_as_torch_does(rows: int, k: int, n: int) -> None:
    x, weight, bias = _inputs(rows, k, n, torch.float32)
    out = invariant_linear(x[None], weight, bias)  # (1, rows, n): leading dimensions kept
    assert out.shape == (1, rows, n)
    reference = x.double() @ weight.double().T + bias.double()
    assert (out[0].double() - reference).abs().max().item() < 1e-4
    assert torch.allclose(invariant_linear(x, weight).double(), x.double() @ weight.double().T, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(dtype: torch.dtype) -> None:
    x, weight, bias = _inputs(2 * BLOCK_M + 3, 160, 96, dtype)  # K over two steps, rows over three tiles
    together = invariant_linear(x, weight, bias)
    alone = torch.cat([invariant_linear(x[i : i + 1], weight, bias) for i in range(len(x))])
    in_sevens = torch.cat([invariant_linear(x[i : i + 7], weight, bias) for i in range(0, len(x), 7)])
    moved = invariant_linear(torch.cat([x[5:], x[:5]]), weight, bias)  # every row in another place
    assert torch.equal(alone, together) and torch.equal(in_sevens, together)
    assert torch.equal(moved, torch.cat([together[5:], together[:5]]))


def test_bad_inputs_are_refused() -> None:
    x, weight, _ = _inputs(3, 64, 32, torch.float32)
    with pytest.raises(ValueError, match="features"):
        invariant_linear(x[:, :10], weight)


_COMPILE_SCRIPT = """
import sys, torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from llm_runtime.model import invariant_matmul as im

arch, dtype = int(sys.argv[1]), sys.argv[2]
signature = {"x_ptr": "*" + dtype, "w_ptr": "*" + dtype, "b_ptr": "*" + dtype, "y_ptr": "*" + dtype,
             **{name: "i32" for name in ("M", "N", "K", "stride_xm", "stride_xk", "stride_wn", "stride_wk",
                                         "stride_ym", "stride_yn")}}
constexprs = {"HAS_BIAS": True, "COMPUTE_FP32": False, "DOT_PRECISION": "ieee" if dtype == "fp32" else "tf32",
              "BLOCK_M": im.BLOCK_M, "BLOCK_N": im.BLOCK_N, "BLOCK_K": im.BLOCK_K}
signature.update({name: "constexpr" for name in constexprs})
compiled = triton.compile(ASTSource(im.invariant_matmul_kernel, signature, constexprs),
                          target=GPUTarget("cuda", arch, 32))
assert compiled.asm["cubin"]
"""


@pytest.mark.parametrize("arch, dtype", [(75, "fp16"), (90, "bf16"), (90, "fp32")], ids=["t4-fp16", "h100-bf16",
                                                                                         "h100-fp32"])
def test_the_kernel_compiles_for_gpu_targets(tmp_path, arch: int, dtype: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT, str(arch), dtype], check=False, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_gpu_rows_are_invariant_on_model_shapes(dtype: torch.dtype) -> None:
    """On the GPU, at a model's sizes: 1 to 512 rows, each row's bits the same; cuBLAS is shown to differ."""
    x, weight, bias = _inputs(512, 576, 1536, dtype)
    together = invariant_linear(x, weight, bias)
    for rows in (1, 3, 64, 200):
        parts = torch.cat([invariant_linear(x[i : i + rows], weight, bias) for i in range(0, 512, rows)])
        assert torch.equal(parts, together), rows
    assert (together.double() - (x.double() @ weight.double().T + bias.double())).abs().max().item() < 0.1
