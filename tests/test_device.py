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


# Emulated profiles (LLM_RUNTIME_DEVICE_PROFILE): a CPU run applies a GPU's rules while computing on the CPU.

def test_the_cpu_profile_is_the_default_and_a_bad_name_is_refused() -> None:
    from llm_runtime.device import CPU_PROFILE, device_profile

    assert device_profile("cpu", environ={}) is CPU_PROFILE
    assert device_profile("cpu", environ={"LLM_RUNTIME_DEVICE_PROFILE": "cpu"}) is CPU_PROFILE
    with pytest.raises(ValueError, match="LLM_RUNTIME_DEVICE_PROFILE must be one of cpu, t4, a100, h100"):
        device_profile("cpu", environ={"LLM_RUNTIME_DEVICE_PROFILE": "v100x"})


def test_a_t4_profile_refuses_bfloat16_and_the_sm80_kernels(monkeypatch) -> None:
    from llm_runtime import load_model
    from llm_runtime.attention.flash import FlashAttentionBackend
    from llm_runtime.attention.flex import FlexAttentionBackend
    from llm_runtime.device import device_profile

    monkeypatch.setenv("LLM_RUNTIME_DEVICE_PROFILE", "t4")
    cpu = torch.device("cpu")
    profile = device_profile(cpu)
    assert profile.emulated and profile.capability == (7, 5) and not profile.supports_bfloat16
    assert resolve_dtype("auto", cpu) == torch.float16  # what a T4 runs, computed on the CPU
    assert "bfloat16 needs compute capability 8.0" in profile.dtype_reason(torch.bfloat16)
    assert profile.dtype_reason(torch.float16) is None
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        assert "compute capability 8.0" in profile.quantized_reason(dtype)
    assert "8.0" in FlashAttentionBackend.is_available(cpu, torch.float16)
    assert "8.0" in FlexAttentionBackend.is_available(cpu, torch.float16)
    # The loader refuses before it reads a byte, with the reason a T4 would give; load_reason says it beforehand.
    from llm_runtime import load_reason

    assert load_reason("cpu") is None and load_reason("cpu", dtype="float32") is None
    assert "bfloat16 needs compute capability 8.0" in load_reason("cpu", dtype="bfloat16")
    assert "int4 and int8 CUDA kernels" in load_reason("cpu", quantization="int8", group_size=32)
    with pytest.raises(ValueError, match="bfloat16 needs compute capability 8.0"):
        load_model(dtype="bfloat16", device="cpu")
    with pytest.raises(ValueError, match="int4 and int8 CUDA kernels"):
        load_model(quantization="gguf", device="cpu")


@pytest.mark.parametrize("name", ["a100", "h100"])
def test_an_ampere_or_newer_profile_allows_them_in_bfloat16_only(monkeypatch, name: str) -> None:
    from llm_runtime import load_model
    from llm_runtime.attention.flash import FlashAttentionBackend
    from llm_runtime.device import device_profile

    monkeypatch.setenv("LLM_RUNTIME_DEVICE_PROFILE", name)
    cpu = torch.device("cpu")
    profile = device_profile(cpu)
    assert profile.supports_bfloat16 and profile.ampere_reason("flash") is None
    assert resolve_dtype("auto", cpu) == torch.bfloat16
    assert profile.dtype_reason(torch.bfloat16) is None and profile.quantized_reason(torch.bfloat16) is None
    # The GPU's quantized kernels compute in bfloat16 only: float32, which the CPU allows, is refused as on CUDA.
    assert "not torch.float32" in profile.quantized_reason(torch.float32)
    from llm_runtime import load_reason

    assert load_reason("cpu", quantization="gguf") is None and load_reason("cpu", dtype="bfloat16") is None
    assert "not torch.float32" in load_reason("cpu", quantization="int8", group_size=32, dtype="float32")
    with pytest.raises(ValueError, match="not torch.float32"):
        load_model(quantization="gguf", dtype="float32", device="cpu")
    # FlashAttention 2's rule holds; what stops it is that the CPU is no GPU.
    assert FlashAttentionBackend.is_available(cpu, torch.bfloat16) == "FlashAttention 2 needs a CUDA GPU"


def test_the_cpu_allows_quantized_layers_in_float32_and_bfloat16(monkeypatch) -> None:
    from llm_runtime.device import CPU_PROFILE

    monkeypatch.delenv("LLM_RUNTIME_DEVICE_PROFILE", raising=False)

    assert CPU_PROFILE.default_dtype == torch.float32 and CPU_PROFILE.supports_bfloat16
    assert CPU_PROFILE.quantized_reason(torch.float32) is None and CPU_PROFILE.quantized_reason(torch.bfloat16) is None
    assert "not torch.float16" in CPU_PROFILE.quantized_reason(torch.float16)
    from llm_runtime import load_reason

    assert load_reason("cpu", quantization="gguf", dtype="float32") is None
    with pytest.raises(ValueError, match="quantization must be one of"):
        load_reason("cpu", quantization="int3")


def test_what_a_lesson_asks_follows_the_profile(monkeypatch) -> None:
    """Lessons ask these instead of torch (tests/lessons/test_device_queries.py): a CPU playing a T4 answers as a
    T4 would (no bfloat16 in hardware: torch.cuda.is_bf16_supported() on a real T4 says True, counting emulation)."""
    from llm_runtime.device import gpu_count, has_fast_bfloat16, memory_in_use, synchronize

    monkeypatch.setenv("LLM_RUNTIME_DEVICE_PROFILE", "t4")
    assert has_fast_bfloat16("cpu") is False
    monkeypatch.setenv("LLM_RUNTIME_DEVICE_PROFILE", "h100")
    assert has_fast_bfloat16("cpu") is True
    monkeypatch.delenv("LLM_RUNTIME_DEVICE_PROFILE")
    assert has_fast_bfloat16("cpu") == bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())  # this CPU's own
    synchronize("cpu")  # nothing queued on the CPU: returns at once
    assert memory_in_use("cpu") is None
    assert gpu_count() == (torch.cuda.device_count() if torch.cuda.is_available() else 0)


def test_triton_mode_switches_the_interpreter_on_without_a_gpu() -> None:
    from llm_runtime.device import triton_mode

    environ: dict[str, str] = {}
    mode = triton_mode(environ)
    if mode == "runs in its interpreter (TRITON_INTERPRET=1)":
        assert environ == {"TRITON_INTERPRET": "1"} and not torch.cuda.is_available()
    else:
        assert environ == {} and mode in ("not installed", "compiles for the GPU")
