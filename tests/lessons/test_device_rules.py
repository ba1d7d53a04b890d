"""A lesson skips what its device cannot run, saying why, instead of raising."""

from __future__ import annotations

import torch

from llm_runtime.device import EMULATED_PROFILES
from llm_runtime.lessons import runs_here


def test_a_part_the_device_can_run_runs_silently() -> None:
    said: list[str] = []
    assert runs_here(EMULATED_PROFILES["h100"].quantized_reason(torch.bfloat16), "the 4-bit model", said.append)
    assert said == []


def test_a_part_a_t4_cannot_run_is_skipped_with_its_reason() -> None:
    said: list[str] = []
    assert not runs_here(EMULATED_PROFILES["t4"].quantized_reason(torch.bfloat16), "the 4-bit model", said.append)
    assert said == ["Skipped here: the 4-bit model. The int4 and int8 CUDA kernels need compute capability 8.0 or "
                    "newer, and this is a T4, compute capability 7.5, played by the CPU."]


def test_a_cpu_playing_a_gpu_times_a_quarter_of_each_load(monkeypatch) -> None:
    from llm_runtime.lessons import workload_size

    monkeypatch.delenv("LLM_RUNTIME_DEVICE_PROFILE", raising=False)
    assert workload_size(64, "cpu") == 64
    monkeypatch.setenv("LLM_RUNTIME_DEVICE_PROFILE", "t4")
    assert workload_size(64, "cpu") == 16 and workload_size(3, "cpu") == 1
    assert workload_size(16, "cpu", at_least=6) == 6 and workload_size(3, "cpu", at_least=6) == 3
