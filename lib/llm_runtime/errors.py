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


class SamplingError(RuntimeError):
    """A step failed after its forward pass, while its logits were masked or sampled: every rank of a sharded model
    had finished the step's collectives, so the step may be run again (its `__cause__` is what failed)."""


# What CUDA says once its context is broken: every later call on the device fails the same way. (Other CUDA
# errors, an invalid launch configuration, no kernel image for this GPU, leave the context usable.)
_STICKY_DEVICE_ERRORS = ("illegal memory access", "illegal address", "illegal instruction", "device-side assert",
                         "unspecified launch failure", "misaligned address", "uncorrectable ECC",
                         "hardware stack error", "context is destroyed")


def is_device_fault(error: BaseException) -> bool:
    """Whether `error` is the device failing in a way that breaks the CUDA context (an illegal memory access, a
    device-side assert), after which nothing can run again in this process: no retry, one request at a time or
    otherwise, can help, so the engine is dead. Running out of memory is not one (a smaller step may fit), nor
    is an error that leaves the context usable."""
    if isinstance(error, torch.OutOfMemoryError):
        return False
    # torch.AcceleratorError (PyTorch 2.8 on) and the RuntimeError of older versions carry CUDA's message.
    return isinstance(error, RuntimeError) and any(text in str(error) for text in _STICKY_DEVICE_ERRORS)
