"""Float16 products on a CPU that plays a T4: float16 in, float32 sums, float16 out, as the T4's tensor cores do.

A T4 has no bfloat16, so a model loaded for one computes in float16 (device.py). Its tensor cores multiply
float16 inputs and add the products in float32, rounding the result to float16 once. A CPU run that plays a
T4 (`LLM_RUNTIME_DEVICE_PROFILE=t4`) loads the same float16 weights, but most CPUs have no float16
arithmetic: PyTorch's float16 product then converts inside its inner loop, and on this package's 2-core CI
machine (AMD EPYC, AVX-512 with bfloat16 but not float16) a 128-row product of the bundled model's MLP took
12.1 ms against 3.3 ms for the same product done as below, 16 rows 1.5 ms against 0.46 ms, one row 0.13 against
0.15 ms. An engine step of 16 decodes spent 81 % of its time in those products.

`HalfProductLinear` keeps the float16 weight (the memory the T4 would hold, which a played T4's memory rule
counts) and computes `x @ W^T` in float32, rounding the result back: the T4's arithmetic at the CPU's float32
speed. (PyTorch's own float16 product sums in float32 too: the two differ in the last bit of 0.2 % of outputs,
the order of additions.) The weight's float32 copy is made once and kept beside it in oneDNN's packed layout
where PyTorch has oneDNN (model/packed_linear.py: another 10-30 % here), remade when the weight changes: a
CPU-side cost of the play, 4 bytes a parameter, not the T4's. One exception: a weight too large for the CPU's
caches (the bundled model's 49,152 x 576 head) read in float32 costs twice the bytes of float16, which decides a
product of one to three rows (the head: 4.4 ms native against 8.8 ms packed for one row, 11.8 against 7.4 ms at
four), so below `FLOAT32_FROM_ROWS` rows such a weight stays in PyTorch's float16 product.

The loader makes every `nn.Linear` one when the CPU plays a GPU in float16 (`emulate_half_products_`); in any
other dtype the layer computes as a plain `nn.Linear` (a float32 copy made for a comparison runs as one).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .packed_linear import PACKING_ROWS_HINT


# Weights of more elements than this (a float32 copy past a few MB of cache) keep the float16 product below
# FLOAT32_FROM_ROWS rows (module docstring).
CACHE_SIZED_WEIGHT = 1 << 22
FLOAT32_FROM_ROWS = 4


class HalfProductLinear(nn.Linear):
    """An nn.Linear whose float16 product is summed in float32 (module docstring); the same parameters."""

    _float_weight: torch.Tensor | None = None  # (out, in) in float32, packed by oneDNN where it can
    _float_weight_of: tuple[int, int] | None = None  # (data pointer, version) of the weight it copies

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype != torch.float16:
            return super().forward(x)
        rows = x.reshape(-1, self.in_features)  # (..., in) -> (M, in)
        if self.weight.numel() > CACHE_SIZED_WEIGHT and rows.shape[0] < FLOAT32_FROM_ROWS:
            return super().forward(x)
        weight = self._weight_in_float32()
        bias = None if self.bias is None else self.bias.float()
        if weight.is_mkldnn:
            out = torch.ops.mkldnn._linear_pointwise(rows.float(), weight, bias, "none", [], "")  # (M, out)
        else:
            out = F.linear(rows.float(), weight, bias)  # (M, out)
        return out.to(torch.float16).reshape(*x.shape[:-1], self.out_features)

    def __getstate__(self) -> dict:
        # A copy (copy.deepcopy, pickle) makes its own float32 weight: a packed one has no storage to copy.
        return {k: v for k, v in self.__dict__.items() if k not in ("_float_weight", "_float_weight_of")}

    def _weight_in_float32(self) -> torch.Tensor:
        key = (self.weight.data_ptr(), self.weight._version)
        if self._float_weight is None or self._float_weight_of != key:
            weight = self.weight.detach().float()
            if weight.device.type == "cpu" and torch.backends.mkldnn.is_available():
                weight = torch.ops.mkldnn._reorder_linear_weight(weight, PACKING_ROWS_HINT)
            self._float_weight, self._float_weight_of = weight, key
        return self._float_weight


def emulate_half_products_(model: nn.Module) -> int:
    """Every plain `nn.Linear` of `model` becomes a `HalfProductLinear` over the same parameters (in place, its
    class changed: weight ties such as a head tied to the embedding stay tied); returns how many."""
    linears = [module for module in model.modules() if type(module) is nn.Linear]
    for module in linears:
        module.__class__ = HalfProductLinear
    return len(linears)
