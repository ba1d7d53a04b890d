"""The batch-invariant RMSNorm in Triton (model/invariant_norm.py): the reference's RMSNorm to rounding, and each
row's bits the same whatever rows come with it. Without CUDA it runs under Triton's interpreter (tests/conftest.py
switches it on before triton is imported)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("TRITON_INTERPRET=1 must be set before triton is imported (tests/conftest.py does it)")
pytest.importorskip("triton")

from llm_runtime.model.invariant_norm import INVARIANT_OPS, invariant_rms_norm
from llm_runtime.model.pointwise import rms_norm

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _inputs(rows: int, size: int, dtype: torch.dtype):
    generator = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(rows, size, generator=generator)).to(DEVICE, dtype)
    weight = (1 + 0.3 * torch.randn(size, generator=generator)).to(DEVICE, dtype)
    return x, weight


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2**-6)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("size", [64, 100, 576])
def test_it_normalises_as_the_reference(dtype: torch.dtype, tolerance: float, size: int) -> None:
    x, weight = _inputs(7, size, dtype)
    out = invariant_rms_norm(x.view(7, 1, size), weight, 1e-5)  # leading dimensions kept
    assert out.shape == (7, 1, size) and out.dtype == dtype
    reference = rms_norm(x, weight, 1e-5).float()
    assert ((out.view(7, size).float() - reference).abs() / reference.abs().clamp_min(1e-3)).max().item() < tolerance


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(dtype: torch.dtype) -> None:
    x, weight = _inputs(33, 576, dtype)
    together = invariant_rms_norm(x, weight, 1e-5)
    alone = torch.cat([invariant_rms_norm(x[i : i + 1], weight, 1e-5) for i in range(len(x))])
    moved = invariant_rms_norm(torch.cat([x[5:], x[:5]]), weight, 1e-5)
    assert torch.equal(alone, together) and torch.equal(moved, torch.cat([together[5:], together[:5]]))
    columns = invariant_rms_norm(x.T.contiguous().T, weight, 1e-5)  # rows not contiguous: copied first
    assert torch.equal(columns, together)


def test_bad_inputs_are_refused_and_the_ops_use_it() -> None:
    x, weight = _inputs(3, 64, torch.float32)
    with pytest.raises(ValueError, match="rows of 64"):
        invariant_rms_norm(x, weight[:10], 1e-5)
    assert INVARIANT_OPS.rms_norm is invariant_rms_norm and INVARIANT_OPS.name == "invariant"
