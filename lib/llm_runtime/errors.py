"""The errors a caller can act on, typed, so every layer (engine, async engine, HTTP) maps them the same way."""

from __future__ import annotations

import torch


class InvalidRequestError(ValueError):
    """A request the engine refuses before anything runs; `param` names the field at fault (HTTP 400)."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param


class EngineBusyError(RuntimeError):
    """Too many requests are waiting: try again later (HTTP 503)."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an error outside any one request; nothing more can run (HTTP 503)."""


# What CUDA says once its context is broken: every later call on the device fails the same way.
_STICKY_DEVICE_ERRORS = ("CUDA error", "illegal memory access", "device-side assert", "CUBLAS_STATUS_EXECUTION_FAILED",
                         "unspecified launch failure", "misaligned address")


def is_device_fault(error: BaseException) -> bool:
    """Whether `error` is the device failing (an illegal memory access, a device-side assert), after which the
    CUDA context is unusable and nothing can run again: no retry, one request at a time or otherwise, can help,
    so the engine is dead. Running out of memory is not one (a smaller step may fit)."""
    if isinstance(error, torch.OutOfMemoryError):
        return False
    if isinstance(error, torch.AcceleratorError):
        return True
    return isinstance(error, RuntimeError) and any(text in str(error) for text in _STICKY_DEVICE_ERRORS)
