"""Device and dtype, chosen in one place.

"auto" means: CUDA when present, else CPU; bfloat16 on GPUs that support it natively (compute
capability 8.0+, Ampere and later), float16 on older ones (a T4), float32 on CPU.
"""

from __future__ import annotations

import torch

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
    device = device if device is not None else resolve_device("auto")
    if device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(device)
        return torch.bfloat16 if major >= 8 else torch.float16
    return torch.float32
