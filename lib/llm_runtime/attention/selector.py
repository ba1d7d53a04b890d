"""Which attention backend an engine runs: asked for by name, or picked by device and what is installed.

`EngineConfig(attention_backend=...)` names one; "auto" lets the environment variable
`LLM_RUNTIME_ATTENTION_BACKEND` choose, and without it the order below does, taking the first
backend that can run with this device, its compute capability, the dtype and the engine's block
size: on CUDA, FlashAttention (sm80+, half precision, and blocks a multiple of 256 tokens, so never
at the default 16) then this package's Triton kernels; on the CPU, this package's C kernel for
decodes (float32 and bfloat16, where a C compiler builds it), else the block-wise PyTorch backend.
A backend asked for by name that cannot run here raises ValueError with the reason. A batch-invariant engine
(lesson 16) gets the backend's `batch_invariant()` setup; "auto" then means the C kernel on the CPU and the
Triton kernels on CUDA, the two that have one.
`torch-gather` is never picked: it is the reference the others are tested against. Nor is `flex`:
it compiles for the pool's size, and its CUDA path has not yet run on a GPU.
"""

from __future__ import annotations

import importlib
from typing import Mapping

import torch

from ..config import ATTENTION_BACKEND_ENV, ATTENTION_BACKENDS
from .backend import AttentionBackend

# name -> (module, class); modules are imported on demand, so optional dependencies stay optional.
_REGISTRY = {
    "torch-gather": ("torch_gather", "TorchGatherBackend"),
    "blockwise": ("blockwise", "BlockwiseBackend"),
    "cpu": ("cpu_backend", "CpuKernelBackend"),
    "flex": ("flex", "FlexAttentionBackend"),
    "triton": ("triton_backend", "TritonBackend"),
    "flash-attn": ("flash", "FlashAttentionBackend"),
}
_AUTO_ORDER = {"cuda": ("flash-attn", "triton", "blockwise"), "cpu": ("cpu", "blockwise")}
_INVARIANT_ORDER = {"cuda": ("triton",), "cpu": ("cpu",)}  # "auto" for a batch-invariant engine
assert set(_REGISTRY) == set(ATTENTION_BACKENDS) - {"auto"}, "config.ATTENTION_BACKENDS and the registry disagree"


def backend_class(name: str) -> type[AttentionBackend]:
    """The class of the backend called `name` (ValueError for an unknown name)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; choose from {', '.join(_REGISTRY)}")
    module, cls = _REGISTRY[name]
    return getattr(importlib.import_module(f"{__package__}.{module}"), cls)


def unavailable_reason(name: str, device: torch.device, dtype: torch.dtype, block_size: int = 16) -> str | None:
    """None when backend `name` can run on this device, dtype and block size; else why not."""
    try:
        cls = backend_class(name)
    except ImportError as error:  # a backend module whose own imports fail
        return f"cannot import it ({error})"
    return cls.is_available(device, dtype) or cls.supports_block_size_on(device, block_size)


def available_backends(device: torch.device | str, dtype: torch.dtype, block_size: int = 16) -> dict[str, str | None]:
    """Every backend with None (runs here) or the reason it does not (lesson 11 prints this)."""
    device = torch.device(device)
    return {name: unavailable_reason(name, device, dtype, block_size) for name in _REGISTRY}


def select_backend(
    requested: str,
    device: torch.device | str,
    dtype: torch.dtype,
    environ: Mapping[str, str] | None = None,
    block_size: int = 16,
    batch_invariant: bool = False,
) -> AttentionBackend:
    """The backend an engine runs: `requested` by name, or for "auto" the environment's choice, else
    the first in this device's order that can run. A named backend that cannot run raises ValueError.
    `batch_invariant`: that backend's batch-invariant setup (ValueError where it has none)."""
    device = torch.device(device)
    name = requested
    if name == "auto" and environ is not None and environ.get(ATTENTION_BACKEND_ENV):
        name = environ[ATTENTION_BACKEND_ENV]
        if name not in ATTENTION_BACKENDS:
            raise ValueError(f"{ATTENTION_BACKEND_ENV}={name!r} is not a backend; choose from "
                             f"{', '.join(ATTENTION_BACKENDS)}")
    if name == "auto":
        order = (_INVARIANT_ORDER if batch_invariant else _AUTO_ORDER).get(device.type, ("blockwise",))
        name = next((c for c in order if unavailable_reason(c, device, dtype, block_size) is None), None)
        if name is None and batch_invariant:
            reasons = "; ".join(f"{c}: {unavailable_reason(c, device, dtype, block_size)}" for c in order)
            raise ValueError(f"no attention backend with a batch-invariant mode runs on {device.type} in {dtype} "
                             f"({reasons or 'none for this device'})")
        cls = backend_class(name or "torch-gather")
    else:
        reason = unavailable_reason(name, device, dtype, block_size)
        if reason is not None:
            raise ValueError(f"attention backend {name!r} cannot run on {device.type} in {dtype} with blocks of "
                             f"{block_size} tokens: {reason}")
        cls = backend_class(name)
    return cls.batch_invariant() if batch_invariant else cls()
