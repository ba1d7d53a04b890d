"""Linear layers with oneDNN-packed weights, for the CPU: the model's own weights, repacked in place.

A CPU matrix multiply spends much of its time rearranging the weight into the blocked layout its
inner kernel reads (panels that fit the vector registers and caches). `nn.Linear` hands MKL the
plain (out, in) weight on every call, so that happens in every layer of every step. oneDNN can
do it once: `torch.ops.mkldnn._reorder_linear_weight` returns the weight already in its blocked
layout, and `torch.ops.mkldnn._linear_pointwise` multiplies by it directly. On this package's
CPU runs that made the linear layers of a 128-row step about 1.6-1.9x faster; vLLM's CPU build
prepacks its weights the same way, and `torch.compile` does it when it freezes a graph.

`pack_linears_(model)` swaps each `nn.Linear` of the model for a `PackedLinear` holding the packed
weight instead of the plain one, so the weights stay one copy in memory. One exception: an LM head
tied to the embedding shares its weight with the embedding lookup, which needs the plain rows; its
packed weight is a second copy (113 MB for the bundled model, counted by the KV budget like every
weight). It is packed anyway because it is the largest matrix multiply of a decode step: on this
package's 2-core CI machine the bundled model's head took 108 ms plain and 79 ms packed for 256
rows, 33 and 18 ms for 64. The change is in place and lasting, like `model.half()`: every later
forward pass (the engine's, `generate`'s) multiplies by the packed weights. An engine does this to
a model it owns (one that `LLM(...)` or `serve` loaded) or when asked (`prepack_weights=True`).

Supported on the CPU in float32, and in bfloat16 where the CPU has bfloat16 instructions oneDNN uses,
when PyTorch was built with oneDNN (`torch.backends.mkldnn`). In bfloat16 on the CI machine packing
made a 64-row step's linears 1.3x faster and a 1-row one's 2.2x, the gain shrinking to 1.1x at 256
rows. The result differs from `nn.Linear`'s in the last bits (another order of additions).
"""

from __future__ import annotations

import torch
from torch import nn

PACKED_DTYPES = (torch.float32, torch.bfloat16)
# The number of rows oneDNN tunes the packed layout for; any row count works with the result.
PACKING_ROWS_HINT = 128


def packing_unsupported_reason(model: nn.Module) -> str | None:
    """None when this model's linear layers can be packed here; otherwise why not."""
    weights = [m.weight for m in model.modules() if isinstance(m, nn.Linear)]
    if not weights:
        return None
    if any(w.device.type != "cpu" for w in weights):
        return "packed weights are for the CPU"
    if not torch.backends.mkldnn.is_available():
        return "this PyTorch was built without oneDNN"
    if any(w.dtype not in PACKED_DTYPES for w in weights):
        return f"packed weights are used in float32 and bfloat16 only, the model is {weights[0].dtype}"
    if weights[0].dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "this CPU has no bfloat16 instructions oneDNN can use"
    return None


class PackedLinear(nn.Module):
    """y = x W^T + b, with W kept only in oneDNN's blocked layout (an opaque tensor: its shape, not its
    storage, is visible). `weight` gives the plain (out, in) matrix back, as a new tensor."""

    def __init__(self, linear: nn.Linear, rows_hint: int = PACKING_ROWS_HINT) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), rows_hint)  # (out, in), blocked
        # Not in the state dict as is (an opaque tensor cannot be saved): _save_to_state_dict writes `weight`.
        self.register_buffer("packed_weight", packed, persistent=False)
        self.bias = linear.bias

    @property
    def weight(self) -> torch.Tensor:
        """The plain (out, in) weight, unpacked into a new tensor (for inspection and saving)."""
        return self.packed_weight.to_dense()

    @property
    def nbytes(self) -> int:
        return self.packed_weight.numel() * self.packed_weight.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # (..., in) -> (M, in)
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed_weight, self.bias, "none", [], "")  # (M, out)
        return out.reshape(*x.shape[:-1], self.out_features)

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = self.weight  # loadable into an unpacked model

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears_(model: nn.Module, rows_hint: int = PACKING_ROWS_HINT) -> list[str]:
    """Replace, in place, every `nn.Linear` of `model` by a `PackedLinear`; returns the names of the layers
    packed (none if it was packed before). Raises ValueError where packing does not apply
    (`packing_unsupported_reason`)."""
    reason = packing_unsupported_reason(model)
    if reason is not None:
        raise ValueError(reason)
    packed = []
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear):
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, PackedLinear(module, rows_hint))
            packed.append(name)
    return packed


def is_packed(model: nn.Module) -> bool:
    """Whether any of the model's linear layers runs on packed weights."""
    return any(isinstance(m, PackedLinear) for m in model.modules())
