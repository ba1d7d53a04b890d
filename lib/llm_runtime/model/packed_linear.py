"""Linear layers with oneDNN-packed weights, for an engine's forward passes on the CPU.

A CPU matrix multiply spends much of its time rearranging the weight into the blocked layout its
inner kernel reads (panels that fit the vector registers and caches). `nn.Linear` hands MKL the
plain (out, in) weight on every call, so that happens in every layer of every step. oneDNN can
do it once: `torch.ops.mkldnn._reorder_linear_weight` returns the weight already in its blocked
layout, and `torch.ops.mkldnn._linear_pointwise` multiplies by it directly. On this package's
CPU runs that made the linear layers of a 128-row step about 1.6-1.9x faster; vLLM's CPU build
prepacks its weights the same way, and `torch.compile` does it when it freezes a graph.

`PackedLinears` packs a model's linear layers once (a second copy of their weights, which the
engine counts against its device memory) and, only while `installed()` is active, routes each
layer's forward through the packed copy. The model itself is not changed: other engines and
`generate` calls on the same model keep using its plain weights, and the packed copy is freed
with the engine.

Supported on the CPU in float32 when PyTorch was built with oneDNN (`torch.backends.mkldnn`).
The result differs from `nn.Linear`'s in the last bits (another order of additions).
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from .causal_lm import CausalLM

# The number of rows oneDNN tunes the packed layout for; any row count works with the result.
PACKING_ROWS_HINT = 128


def packing_unsupported_reason(model: CausalLM) -> str | None:
    """None when this model's linear layers can be packed here; otherwise why not."""
    if model.device.type != "cpu":
        return "packed weights are for the CPU"
    if model.dtype != torch.float32:
        return f"packed weights are used in float32 only, the model is {model.dtype}"
    if not torch.backends.mkldnn.is_available():
        return "this PyTorch was built without oneDNN"
    return None


class PackedLinears:
    """A packed copy of every `nn.Linear` weight of `model`, used by its forward only inside `installed()`."""

    def __init__(self, model: CausalLM, rows_hint: int = PACKING_ROWS_HINT) -> None:
        reason = packing_unsupported_reason(model)
        if reason is not None:
            raise ValueError(reason)
        self._packed: list[tuple[nn.Linear, torch.Tensor]] = []
        with torch.inference_mode():
            for module in model.modules():
                if isinstance(module, nn.Linear):
                    weight = module.weight.detach()  # (out, in)
                    self._packed.append((module, torch.ops.mkldnn._reorder_linear_weight(weight, rows_hint)))
        # An opaque oneDNN tensor: its size, not its storage, is visible (the blocked layout pads a little).
        self.nbytes = sum(packed.numel() * packed.element_size() for _, packed in self._packed)

    def __len__(self) -> int:
        return len(self._packed)

    @contextmanager
    def installed(self) -> Iterator[None]:
        """Within this block, each packed layer's forward multiplies by its packed weight."""
        for module, packed in self._packed:
            module.forward = types.MethodType(_packed_forward(packed, module.bias), module)  # an instance attribute
        try:
            yield
        finally:
            for module, _ in self._packed:
                del module.forward  # the class's own forward again


def _packed_forward(packed: torch.Tensor, bias: torch.Tensor | None):
    def forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # (..., in) -> (M, in)
        out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")  # (M, out)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    return forward
