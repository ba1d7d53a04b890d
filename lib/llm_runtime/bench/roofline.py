"""The hardware limit: what a workload costs in FLOPs and bytes, and what this machine can do per second.

A step of a transformer multiplies every processed token by every weight matrix (2 FLOPs per
weight per token), attends over the token's past (4 x layers x heads x head_dim FLOPs per key:
q.k and the weighted sum of v), and turns each sampled position into logits (2 x hidden x vocab).
It also reads every weight once per step and every cached key and value it attends to. The time a
run cannot beat is max(FLOPs / peak FLOP/s, bytes / bandwidth); both peaks are measured here, on
this machine (`measure_peaks`).

`machine_peaks` is the measurement every lesson and `bench` quotes: taken once (best of several runs, at
the thread count the engine uses), kept for the process and in a file keyed by the machine (its processor or
GPU, torch's thread count and version), so lessons run one after the other quote the same machine rather than
each its own noisy moment. The bandwidth is a read stream (the sum of a buffer far larger than the caches: bytes
read once over the time), as a decode step reads its weights; it does not depend on the dtype, and lessons 09, 12
and 19 quote this one figure. The matmul peak is kept per dtype.
`machine_peaks(..., refresh=True)` measures again. Where the CPU plays a GPU (LLM_RUNTIME_DEVICE_PROFILE), the peaks
are that GPU's datasheet figures: the roofline a lesson draws is the played device's, while its timings stay the
CPU's (which has no arithmetic units for float16: its own float16 peak would put one row right of the ridge).
`datasheet_peaks("h100", torch.bfloat16)` is a GPU's datasheet roofline wherever a lesson compares this machine with
one: the figures are kept once, in `device.EMULATED_PROFILES`.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..config import ModelConfig
from ..cache_dir import default_cache_dir
from ..device import EMULATED_PROFILES, DeviceProfile, device_profile, synchronize


def linear_parameters(config: ModelConfig) -> int:
    """Weights every processed token is multiplied by (attention projections and MLP of all layers)."""
    attention = config.hidden_size * (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    attention += config.num_heads * config.head_dim * config.hidden_size
    return config.num_layers * (attention + 3 * config.hidden_size * config.intermediate_size)


def request_flops(config: ModelConfig, prompt_len: int, output_len: int) -> float:
    """FLOPs of one request: prompt + output - 1 processed tokens, output_len sampled positions."""
    processed = prompt_len + output_len - 1  # the last sampled token is never fed back
    linear = 2.0 * linear_parameters(config) * processed
    # token at position t attends to t + 1 keys: sum over t < processed of (t + 1)
    keys = processed * (processed + 1) / 2
    attention = 4.0 * config.num_layers * config.num_heads * config.head_dim * keys
    logits = 2.0 * config.hidden_size * config.vocab_size * output_len
    return linear + attention + logits


def weight_bytes(config: ModelConfig, dtype_size: int) -> int:
    """Bytes read per forward pass: the linear weights and the output projection."""
    return (linear_parameters(config) + config.hidden_size * config.vocab_size) * dtype_size


@dataclass(frozen=True)
class MachinePeaks:
    """Measured matrix-multiply throughput (FLOP/s) and memory bandwidth (bytes/s) of one device."""

    device: str
    dtype: str
    matmul_flops: float
    memory_bandwidth: float

    @property
    def ridge_point(self) -> float:
        """FLOPs per byte above which a kernel is compute-bound."""
        return self.matmul_flops / self.memory_bandwidth


def _best_time(fn, repeats: int, device: torch.device, budget_s: float = 3.0) -> float:
    """The fastest of `repeats` timed runs after a warm-up; after three, no more once `budget_s` is spent (a
    dtype the device has no fast kernel for, float16 on most CPUs, takes seconds a run)."""
    fn()  # warm-up
    synchronize(device)
    best, started = float("inf"), time.perf_counter()
    for repeat in range(repeats):
        if repeat >= 3 and time.perf_counter() - started > budget_s:
            break
        start = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


@torch.inference_mode()
def measure_peaks(device: torch.device | str, dtype: torch.dtype, matmul_size: int | None = None,
                  read_bytes: int | None = None, repeats: int = 5) -> MachinePeaks:
    """Best-of-`repeats` square matmul FLOP/s and read bandwidth (bytes of a buffer summed, over the time) on
    `device`: a read stream, as a decode step reads its weights (a copy would count writes too)."""
    device = torch.device(device)
    on_gpu = device.type == "cuda"
    n = matmul_size or (8192 if on_gpu else 1536)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    matmul_time = _best_time(lambda: torch.mm(a, b), repeats, device)
    nbytes = read_bytes or (2**30 if on_gpu else 2**28)
    source = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    read_time = _best_time(lambda: source.sum(), repeats, device)
    return MachinePeaks(str(device), str(dtype).removeprefix("torch."), 2.0 * n**3 / matmul_time,
                        source.numel() * 4 / read_time)


PEAKS_FILE = "machine_peaks.json"
MACHINE_PEAK_REPEATS = 10  # best of: a figure no slower moment of the machine drags down


def _processor_name() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), else what the platform module says."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_key(device: torch.device | str) -> str:
    """What the peaks of `device` depend on: the processor or GPU, the threads torch computes with, torch."""
    device = torch.device(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else _processor_name()
    return f"{device.type}: {name}, {torch.get_num_threads()} threads, torch {torch.__version__}"


def machine_peaks(device: torch.device | str, dtype: torch.dtype, *, refresh: bool = False,
                  cache_dir: Path | str | None = None) -> MachinePeaks:
    """This machine's peaks for `dtype` on `device`: measured once (`measure_peaks`, best of
    MACHINE_PEAK_REPEATS) and reused, in this process and across processes from `cache_dir`/machine_peaks.json
    (default: the package's cache folder). `refresh=True` measures again and keeps the new figures."""
    profile = device_profile(device)
    if profile.emulated:
        return replace(datasheet_peaks(profile, dtype), device=f"{profile.name} (datasheet; played by the CPU)")
    path = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if refresh:
        _cached_peaks.cache_clear()
    return _cached_peaks(str(torch.device(device)), str(dtype).removeprefix("torch."), path / PEAKS_FILE, refresh)


def datasheet_peaks(gpu: str | DeviceProfile, dtype: torch.dtype | str) -> MachinePeaks:
    """A GPU's datasheet peaks for `dtype`: "t4", "a100", "h100" (or a profile that has them), its float32 figure
    for a dtype the datasheet does not list."""
    profile = EMULATED_PROFILES[gpu] if isinstance(gpu, str) else gpu
    flops, key = dict(profile.datasheet_flops), str(dtype).removeprefix("torch.")
    if profile.datasheet_bandwidth is None or not flops:
        raise ValueError(f"no datasheet peaks for {profile.describe()}")
    bandwidth = profile.datasheet_bandwidth
    return MachinePeaks(f"{profile.name} (datasheet)", key, flops.get(key, flops["float32"]), bandwidth)


@functools.cache
def _cached_peaks(device: str, dtype: str, path: Path, refresh: bool) -> MachinePeaks:
    key = machine_key(device)
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        saved = {}
    entry = saved.get(key)
    if refresh or not isinstance(entry, dict) or "read_bandwidth" not in entry:
        entry = {}  # nothing kept, or kept by a version that measured a copy's bandwidth: measure all again
    flops = entry.get("matmul_flops", {})
    if dtype not in flops:
        measured = measure_peaks(device, getattr(torch, dtype), repeats=MACHINE_PEAK_REPEATS)
        entry = {"read_bandwidth": entry.get("read_bandwidth", measured.memory_bandwidth),
                 "matmul_flops": {**flops, dtype: measured.matmul_flops}}
        saved[key] = entry
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            temporary = path.with_suffix(f".{os.getpid()}.tmp")
            temporary.write_text(json.dumps(saved, indent=1) + "\n")
            temporary.replace(path)  # whole or not at all, if two processes write at once
        except OSError:
            pass  # a read-only cache folder: the figures still hold for this process
    return MachinePeaks(device, dtype, entry["matmul_flops"][dtype], entry["read_bandwidth"])


def decode_step_intensity(config: ModelConfig, dtype_size: int, batch_size: int, context_len: int = 0) -> float:
    """FLOPs per byte of one decode step: `batch_size` sequences, each one new token over `context_len`
    cached ones. The weights are read once for the whole batch, so intensity grows with the batch
    until the KV reads (which grow with it too) take over."""
    per_token = (2.0 * linear_parameters(config) + 2.0 * config.hidden_size * config.vocab_size
                 + 4.0 * config.num_layers * config.num_heads * config.head_dim * context_len)
    kv_read = batch_size * context_len * config.kv_bytes_per_token(dtype_size)
    return batch_size * per_token / (weight_bytes(config, dtype_size) + kv_read)


def regime(intensity: float, peaks: MachinePeaks) -> str:
    """"memory-bound" left of the ridge point (time = bytes / bandwidth), "compute-bound" right of it."""
    return "memory-bound" if intensity < peaks.ridge_point else "compute-bound"


def ridge_batch_size(config: ModelConfig, dtype_size: int, peaks: MachinePeaks, context_len: int = 0) -> int | None:
    """The smallest decode batch whose step is compute-bound on this machine (None: not below 4096)."""
    for batch_size in range(1, 4097):
        if decode_step_intensity(config, dtype_size, batch_size, context_len) >= peaks.ridge_point:
            return batch_size
    return None
