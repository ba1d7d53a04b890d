"""The pointwise parts of a decoder layer, eager or compiled: RMSNorm, SiLU-and-multiply, rotary.

Between its matrix multiplies a layer runs a dozen small elementwise operations: RMSNorm's upcast,
square, mean, rsqrt, multiply and downcast; rotary's slices, negation, concatenation, two multiplies
and an add; the MLP's SiLU and multiply. Eager PyTorch runs each as its own kernel that reads and
writes the whole activation: on a GPU each is a kernel launch (a few microseconds of CPU time, far
more than the kernel takes at decode), on the CPU each is a pass over memory. `torch.compile` traces
these functions and generates one fused kernel per function (Triton on a GPU, vectorized C++ on the
CPU) that reads its inputs once.

A model's modules call `module.ops.<name>`; `set_pointwise_ops_(model, ops)` points them all at one
`PointwiseOps`. `EAGER_OPS` is the plain functions; `compiled_ops()` wraps them in `torch.compile`
with dynamic shapes, so the token count of a step does not trigger a recompilation (only sizes 0 and 1
are specialized: a one-token step compiles once more). The compiled functions compute the same
formulas; their results may differ from eager's in the last bits (another order of operations).

Measured on this package's 2-core CI CPU (rows of the bundled model's sizes), the gains are mixed: in
bfloat16 at 2048 rows rotary took 0.73 ms eager and 0.32 ms compiled, SiLU-and-multiply 1.23 and 1.06
ms, but RMSNorm in float32 0.23 and 0.38 ms; at one row every compiled call is slower (RMSNorm 18 ->
32 us: the guards that check the inputs before every call cost more than the arithmetic). On the
standard benchmark the engine was no faster with them compiled, so it compiles them by default only on
CUDA, where each eager operation is also a kernel launch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight over the last dimension, normalised in float32 as the reference does."""
    input_dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(input_dtype)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate: silu(gate) * up."""
    return F.silu(gate) * up


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x_i, x_{i+d/2}) by each position's angle. x (B, heads, T, d); cos, sin (B, T, d)."""
    cos, sin = cos[:, None], sin[:, None]  # (B, 1, T, d): broadcast over heads
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@dataclass(frozen=True)
class PointwiseOps:
    """The functions a model's layers call between their matrix multiplies."""

    name: str
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    silu_and_mul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    rotary: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

    def __deepcopy__(self, memo: dict) -> "PointwiseOps":
        return self  # functions, shared: a copied model runs the same ones (compiled ones cannot be copied)


EAGER_OPS = PointwiseOps("eager", rms_norm, silu_and_mul, rotary)


def compiled_ops() -> PointwiseOps:
    """The same functions through `torch.compile` (inductor), dynamic in every dimension."""
    return PointwiseOps("compiled", *(torch.compile(fn, dynamic=True) for fn in (rms_norm, silu_and_mul, rotary)))


def set_pointwise_ops_(model: nn.Module, ops: PointwiseOps) -> int:
    """Point every module of `model` that has pointwise ops at `ops`, in place; returns how many."""
    modules = [m for m in model.modules() if hasattr(m, "ops") and isinstance(m.ops, PointwiseOps)]
    for module in modules:
        module.ops = ops
    return len(modules)


def pointwise_ops_of(model: nn.Module) -> PointwiseOps:
    """The ops the model's modules use now (the first one's)."""
    return next((m.ops for m in model.modules() if isinstance(getattr(m, "ops", None), PointwiseOps)), EAGER_OPS)
