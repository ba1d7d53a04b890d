"""Device and dtype resolution: one place decides, and bad names are refused."""

from __future__ import annotations

import pytest
import torch

from llm_runtime import resolve_device, resolve_dtype


def test_auto_on_this_machine() -> None:
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32


def test_names_and_dtypes_pass_through() -> None:
    assert resolve_dtype("bf16") == torch.bfloat16 and resolve_dtype("float16") == torch.float16
    assert resolve_dtype(torch.float64) == torch.float64
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("bad", ["int8", "fp8", torch.int32])
def test_bad_dtype(bad) -> None:
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype(bad)


def test_bad_device() -> None:
    with pytest.raises(ValueError, match="device"):
        resolve_device("tpu:7")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_without_cuda_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_device("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_dtype_on_gpu() -> None:
    major, _ = torch.cuda.get_device_capability()
    assert resolve_dtype("auto", torch.device("cuda")) == (torch.bfloat16 if major >= 8 else torch.float16)
