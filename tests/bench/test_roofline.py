"""The roofline's arithmetic: FLOPs and bytes of a decode step, and on which side of the ridge it falls."""

from __future__ import annotations

import math

import pytest

from llm_runtime.bench.roofline import (MachinePeaks, decode_step_intensity, regime, ridge_batch_size,
                                        weight_bytes)
from llm_runtime.config import ModelConfig

CONFIG = ModelConfig(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                     num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192)


@pytest.mark.parametrize("dtype_size", [2, 4])
def test_without_context_a_decode_step_does_two_flops_per_weight_byte_per_row(dtype_size: int) -> None:
    # Every weight is read once per step and multiplied once per row (2 FLOPs): intensity = 2 x rows / size.
    for batch_size in (1, 8, 64):
        assert decode_step_intensity(CONFIG, dtype_size, batch_size) == pytest.approx(2 * batch_size / dtype_size)


def test_cached_context_adds_kv_reads_that_grow_with_the_batch() -> None:
    short, long = (decode_step_intensity(CONFIG, 2, 64, context) for context in (0, 4096))
    assert long < short  # the KV bytes per row cost more than the attention FLOPs they feed
    kv = 64 * 4096 * CONFIG.kv_bytes_per_token(2)
    assert kv > weight_bytes(CONFIG, 2)  # at batch 64 and 4k context the KV reads outweigh the weights


def test_regime_and_the_ridge_batch_size() -> None:
    h100 = MachinePeaks("cuda", "bfloat16", matmul_flops=990e12, memory_bandwidth=3.35e12)
    assert regime(1.0, h100) == "memory-bound" and regime(1000.0, h100) == "compute-bound"
    assert ridge_batch_size(CONFIG, 2, h100) == math.ceil(h100.ridge_point * 2 / 2)  # 2 b / 2 >= ridge
    laptop = MachinePeaks("cpu", "float32", matmul_flops=1e11, memory_bandwidth=1e10)  # ridge 10 FLOP/byte
    assert ridge_batch_size(CONFIG, 4, laptop) == 20
    assert ridge_batch_size(CONFIG, 2, MachinePeaks("x", "y", 1e18, 1.0)) is None


def test_machine_peaks_are_measured_once_and_shared_by_later_processes(tmp_path, monkeypatch) -> None:
    """One measurement of the machine: the first call measures, later calls (this process, or another one
    reading the file) reuse it; the bandwidth is one figure for every dtype; refresh measures again."""
    import torch

    from llm_runtime.bench import roofline

    calls = []

    def fake_measure(device, dtype, repeats):
        calls.append((str(dtype), repeats))
        return MachinePeaks(str(device), str(dtype), 100e9 * (len(calls)), 30e9 + len(calls))

    monkeypatch.setattr(roofline, "measure_peaks", fake_measure)
    roofline._cached_peaks.cache_clear()
    first = roofline.machine_peaks("cpu", torch.float32, cache_dir=tmp_path)
    assert roofline.machine_peaks("cpu", torch.float32, cache_dir=tmp_path) == first
    assert calls == [("torch.float32", roofline.MACHINE_PEAK_REPEATS)]
    roofline._cached_peaks.cache_clear()  # a new process: the file answers
    assert roofline.machine_peaks("cpu", torch.float32, cache_dir=tmp_path) == first and len(calls) == 1
    bf16 = roofline.machine_peaks("cpu", torch.bfloat16, cache_dir=tmp_path)  # a new dtype: its matmul only
    assert len(calls) == 2 and bf16.memory_bandwidth == first.memory_bandwidth
    assert bf16.matmul_flops != first.matmul_flops and bf16.dtype == "bfloat16"
    again = roofline.machine_peaks("cpu", torch.float32, cache_dir=tmp_path, refresh=True)
    assert len(calls) == 3 and again.memory_bandwidth != first.memory_bandwidth
    key = roofline.machine_key("cpu")
    assert f"{torch.get_num_threads()} threads" in key and torch.__version__ in key
    saved = __import__("json").loads((tmp_path / roofline.PEAKS_FILE).read_text())
    assert set(saved[key]["matmul_flops"]) == {"float32"}  # refresh starts the machine's entry afresh
    roofline._cached_peaks.cache_clear()


def test_a_played_gpus_roofline_is_its_datasheet_and_its_timings_are_not_its_own(monkeypatch) -> None:
    """Where the CPU plays a GPU, machine_peaks gives that GPU's datasheet (nothing is measured: the CPU's own
    float16 peak would put one row right of the ridge), so one row is memory-bound as on the GPU; and
    timed_on_the_device says the lesson's timings are the CPU's, not the GPU's."""
    import torch

    from llm_runtime.bench import roofline
    from llm_runtime.lessons import timed_on_the_device

    monkeypatch.setattr(roofline, "measure_peaks", lambda *a, **k: pytest.fail("a played GPU's peaks are not measured"))
    monkeypatch.setenv("LLM_RUNTIME_DEVICE_PROFILE", "t4")
    t4 = roofline.machine_peaks("cpu", torch.float16)
    assert (t4.matmul_flops, t4.memory_bandwidth, t4.dtype) == (65e12, 320e9, "float16") and "T4" in t4.device
    assert roofline.machine_peaks("cpu", torch.float32).matmul_flops == 8.1e12  # (a float32 copy: its own figure)
    assert regime(decode_step_intensity(CONFIG, 2, 1), t4) == "memory-bound"
    assert not timed_on_the_device("cpu")
    monkeypatch.setenv("LLM_RUNTIME_DEVICE_PROFILE", "h100")
    assert roofline.machine_peaks("cpu", torch.bfloat16).matmul_flops == 989e12
    h100 = roofline.datasheet_peaks("h100", torch.bfloat16)  # what a lesson compares this machine with
    assert (h100.matmul_flops, h100.memory_bandwidth, h100.device) == (989e12, 3.35e12, "H100 (datasheet)")
    assert roofline.datasheet_peaks("t4", "bfloat16").matmul_flops == 8.1e12  # no bfloat16 on a T4: float32's
    monkeypatch.delenv("LLM_RUNTIME_DEVICE_PROFILE")
    assert timed_on_the_device("cpu")


def test_peaks_kept_by_a_copy_measurement_are_measured_again(tmp_path, monkeypatch) -> None:
    """An entry from before the bandwidth was a read stream (a copy's read + write) is not quoted: measured again."""
    import json

    import torch

    from llm_runtime.bench import roofline

    key = roofline.machine_key("cpu")
    (tmp_path / roofline.PEAKS_FILE).write_text(json.dumps(
        {key: {"memory_bandwidth": 1.0, "matmul_flops": {"float32": 2.0}}}))
    monkeypatch.setattr(roofline, "measure_peaks", lambda device, dtype, repeats: MachinePeaks("cpu", "float32", 5e9, 7e9))
    roofline._cached_peaks.cache_clear()
    peaks = roofline.machine_peaks("cpu", torch.float32, cache_dir=tmp_path)
    assert (peaks.matmul_flops, peaks.memory_bandwidth) == (5e9, 7e9)
    assert json.loads((tmp_path / roofline.PEAKS_FILE).read_text())[key]["read_bandwidth"] == 7e9
    roofline._cached_peaks.cache_clear()


def test_the_bandwidth_is_a_read_stream(monkeypatch) -> None:
    """measure_peaks times a read of the buffer (bytes read once, as a decode step reads its weights), not a copy,
    whose writes a step does not make."""
    import torch

    from llm_runtime.bench import roofline

    monkeypatch.setattr(torch.Tensor, "copy_", lambda *a, **k: pytest.fail("the bandwidth is not a copy's"))
    peaks = roofline.measure_peaks("cpu", torch.float32, matmul_size=64, read_bytes=1 << 22, repeats=2)
    assert peaks.memory_bandwidth > 0 and peaks.matmul_flops > 0
