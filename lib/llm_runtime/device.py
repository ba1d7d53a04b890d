"""Device and dtype, chosen in one place, and what a device can do, described in one place.

"auto" means: CUDA when present, else CPU; bfloat16 on GPUs that support it natively (compute
capability 8.0+, Ampere and later), float16 on older ones (a T4), float32 on CPU.

`device_profile(device)` says what a device can run: its compute capability, the dtypes it computes in
natively, its memory, and the kernels that need Ampere or newer (FlashAttention 2, flex's Triton lowering,
the int4 and int8 quantized products). Whoever chooses a path asks it: `resolve_dtype`, the loader, the
attention backends. On the CPU, `LLM_RUNTIME_DEVICE_PROFILE=t4 | a100 | h100` makes the profile that GPU's:
the run still computes on the CPU, but takes that GPU's dtype default and refuses what it would refuse (its
dtypes, its kernels, more memory than it has), so a CPU run catches a lesson that would raise on a reader's T4.
(Its float16 products are summed in float32, as a T4's tensor cores sum them: model/half_products.py.)
`LLM_RUNTIME_CPU_ISA=avx2` plays a CPU without AVX-512 the same way (`cpu_target`: what the C kernels are built for).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

import torch

DEVICE_PROFILE_ENV = "LLM_RUNTIME_DEVICE_PROFILE"
CPU_ISA_ENV = "LLM_RUNTIME_CPU_ISA"
# What the package's C kernels are built for (-march): this CPU's own instructions, or an x86-64 CPU without
# AVX-512 (x86-64-v3: AVX2 and FMA, a laptop's or an older server's), which a run on any x86 machine can play.
CPU_TARGETS = {"native": "native", "avx2": "x86-64-v3"}
AMPERE = (8, 0)  # bfloat16 in hardware, FlashAttention 2, Triton's flex templates, the quantized kernels


@dataclass(frozen=True)
class DeviceProfile:
    """What one device can run. `capability` is None for the CPU; `emulated` when a CPU run plays a GPU."""

    name: str
    capability: tuple[int, int] | None = None
    # The device's memory; None for the CPU (EngineConfig.cpu_device_memory emulates one). A played GPU's limits
    # what an engine may hold beside the CPU's budget (engine/kv_budget.check_profile_memory).
    memory_bytes: int | None = None
    emulated: bool = False
    # A played GPU's datasheet peaks (dense matmul FLOP/s per dtype, memory bandwidth in bytes/s): the roofline of a
    # CPU run that plays it is the GPU's (bench/roofline.machine_peaks), not the CPU's in a dtype it has no units for.
    datasheet_flops: tuple[tuple[str, float], ...] = ()
    datasheet_bandwidth: float | None = None

    @property
    def is_gpu(self) -> bool:
        """Whether a GPU's rules apply (on a GPU, or on the CPU playing one)."""
        return self.capability is not None

    @property
    def default_dtype(self) -> torch.dtype:
        """What "auto" resolves to: float32 on the CPU, bfloat16 from Ampere on, float16 before it."""
        if not self.is_gpu:
            return torch.float32
        return torch.bfloat16 if self.supports_bfloat16 else torch.float16

    @property
    def supports_bfloat16(self) -> bool:
        return not self.is_gpu or self.capability >= AMPERE

    def dtype_reason(self, dtype: torch.dtype) -> str | None:
        """None when the device computes in `dtype`; else why not (a T4 has no bfloat16)."""
        if dtype == torch.bfloat16 and not self.supports_bfloat16:
            return f"bfloat16 needs compute capability 8.0 or newer, and this is {self.describe()} (use float16)"
        return None

    def ampere_reason(self, kernels: str) -> str | None:
        """None when kernels that need compute capability 8.0 run here; else why `kernels` (plural) cannot."""
        if self.is_gpu and self.capability < AMPERE:
            return f"{kernels} need compute capability 8.0 or newer, and this is {self.describe()}"
        return None

    def quantized_dtypes(self) -> tuple[torch.dtype, ...]:
        """The dtypes quantized layers compute in: bfloat16 (the GPU kernels' only one) or, on the CPU, float32."""
        if not self.is_gpu:
            return (torch.bfloat16, torch.float32)
        return (torch.bfloat16,) if self.supports_bfloat16 else ()

    def quantized_reason(self, dtype: torch.dtype) -> str | None:
        """None when quantized layers (int8, int4, gguf) run here in `dtype`; else why not."""
        reason = self.ampere_reason("the int4 and int8 CUDA kernels")
        if reason is not None:
            return reason
        allowed = self.quantized_dtypes()
        if dtype not in allowed:
            names = " or ".join(str(d) for d in allowed)
            return f"quantized layers compute in {names} on {self.describe()}, not {dtype}"
        return None

    def describe(self) -> str:
        if not self.is_gpu:
            return "the CPU"
        major, minor = self.capability
        played = ", played by the CPU" if self.emulated else ""
        return f"a {self.name}, compute capability {major}.{minor}{played}"


# The GPUs a reader has, as a CPU run can play them: their compute capability and memory.
EMULATED_PROFILES: dict[str, DeviceProfile] = {
    "t4": DeviceProfile("T4", (7, 5), 15 * 2**30, emulated=True,
                        datasheet_flops=(("float16", 65e12), ("float32", 8.1e12)), datasheet_bandwidth=320e9),
    "a100": DeviceProfile("A100", (8, 0), 40 * 2**30, emulated=True,
                          datasheet_flops=(("bfloat16", 312e12), ("float16", 312e12), ("float32", 19.5e12)),
                          datasheet_bandwidth=1.555e12),
    "h100": DeviceProfile("H100", (9, 0), 80 * 2**30, emulated=True,  # SXM
                          datasheet_flops=(("bfloat16", 989e12), ("float16", 989e12), ("float32", 67e12)),
                          datasheet_bandwidth=3.35e12),
}
CPU_PROFILE = DeviceProfile("CPU")


def device_profile(device: torch.device | str = "cpu", environ: Mapping[str, str] | None = None) -> DeviceProfile:
    """What `device` can run: a GPU's own properties on CUDA; on the CPU, the CPU, or the GPU that
    `LLM_RUNTIME_DEVICE_PROFILE` in `environ` (the process's environment by default) names."""
    device = torch.device(device)
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        return DeviceProfile(properties.name, tuple(torch.cuda.get_device_capability(device)), properties.total_memory)
    name = (os.environ if environ is None else environ).get(DEVICE_PROFILE_ENV, "").strip().lower()
    if not name or name == "cpu":
        return CPU_PROFILE
    if name not in EMULATED_PROFILES:
        raise ValueError(f"{DEVICE_PROFILE_ENV} must be one of cpu, {', '.join(EMULATED_PROFILES)}, got {name!r}")
    return EMULATED_PROFILES[name]


def has_fast_bfloat16(device: torch.device | str) -> bool:
    """Whether `device` computes in bfloat16 in hardware: a GPU from Ampere on (or the CPU playing one; a T4 does
    not, whatever `torch.cuda.is_bf16_supported()` says, since that counts emulation), or a CPU with AVX-512 BF16
    or AMX (oneDNN's own check)."""
    profile = device_profile(device)
    if profile.is_gpu:
        return profile.supports_bfloat16
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def synchronize(device: torch.device | str) -> None:
    """Wait until the work queued on `device` is done (a GPU runs kernels asynchronously: time a call only after
    this); nothing to wait for on the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gpu_count() -> int:
    """How many CUDA GPUs this process sees (0 on a CPU-only machine, whatever profile the CPU plays)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def memory_in_use(device: torch.device | str) -> tuple[int, int] | None:
    """(allocated, reserved) bytes of PyTorch's caching allocator on a GPU; None on the CPU, whose memory a
    process's resident size measures instead."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)


def triton_mode(environ: MutableMapping[str, str] | None = None) -> str:
    """How this package's Triton kernels run here: "not installed", "compiles for the GPU", or, without a GPU,
    "runs in its interpreter", for which this sets TRITON_INTERPRET=1 in `environ` (the process's environment by
    default). Triton reads it when a kernel is decorated, so call this before anything imports Triton (importing
    llm_runtime does not)."""
    environ = os.environ if environ is None else environ
    if importlib.util.find_spec("triton") is None:
        return "not installed"
    if torch.cuda.is_available():
        return "compiles for the GPU"
    environ["TRITON_INTERPRET"] = "1"
    return "runs in its interpreter (TRITON_INTERPRET=1)"


def cpu_target(environ: Mapping[str, str] | None = None) -> str:
    """The -march the package's C kernels are built for: "native" (this CPU's instructions), or with
    `LLM_RUNTIME_CPU_ISA=avx2` in `environ` "x86-64-v3": the kernels as a CPU without AVX-512 builds them, so a
    run here takes every path such a CPU takes (the native step and the AVX-512 kernels unavailable, with their
    reason), as the device profile plays a GPU. (PyTorch's own kernels follow ATEN_CPU_CAPABILITY and
    ONEDNN_MAX_CPU_ISA; `make test` sets those too.)"""
    name = (os.environ if environ is None else environ).get(CPU_ISA_ENV, "").strip().lower() or "native"
    if name not in CPU_TARGETS:
        raise ValueError(f"{CPU_ISA_ENV} must be one of {', '.join(CPU_TARGETS)}, got {name!r}")
    return CPU_TARGETS[name]


_DTYPE_NAMES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float64": torch.float64, "fp64": torch.float64, "double": torch.float64,
}


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """"auto" -> cuda if available else cpu; anything else is checked and returned as a torch.device."""
    if isinstance(device, str) and device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}") from error
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available on this machine")
    return resolved


def resolve_dtype(dtype: str | torch.dtype = "auto", device: torch.device | None = None) -> torch.dtype:
    """"auto" -> the fastest accurate dtype for `device`; names like "bf16" or torch dtypes pass through."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPE_NAMES.values():
            raise ValueError(f"dtype must be a floating point type, got {dtype}")
        return dtype
    if dtype != "auto":
        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPE_NAMES)}, got {dtype!r}")
        return _DTYPE_NAMES[dtype]
    return device_profile(device if device is not None else resolve_device("auto")).default_dtype
