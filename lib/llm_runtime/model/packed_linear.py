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

Inside a `torch.compile` graph (worker/compiled_forward.py) the product goes through `packed_linear`, an
operator of this package's: inductor lowers oneDNN's packed product only over weights it froze into the
graph itself, not over a packed weight the graph reads as an input.
"""

from __future__ import annotations

import torch
from torch import nn

from ..native.operators import define_operator

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


def _packed_product(rows: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """rows (M, in) @ W^T + b -> (M, out), W (out, in) in oneDNN's packed layout."""
    return torch.ops.mkldnn._linear_pointwise(rows, packed_weight, bias, "none", [], "")


packed_linear = define_operator("packed_linear", _packed_product, dispatch_keys=("CPU", "MkldnnCPU"))  # one operator to torch.compile


@torch.library.register_fake("llm_runtime::packed_linear")
def _(rows: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return rows.new_empty(rows.shape[0], packed_weight.shape[0])


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
        # Batch invariance (model/batch_invariant.py), one of two ways. Where oneDNN multiplies one row by another
        # kernel than two or more (with other rounding), a single row is multiplied as two and the first result
        # kept. Where its kernel and rounding change with the number of rows (AMX's bfloat16 kernels), every
        # product is made in calls of exactly `row_tile` rows, the last padded with zeros.
        self.single_row_as_two = False
        self.row_tile: int | None = None

    @property
    def weight(self) -> torch.Tensor:
        """The plain (out, in) weight, unpacked into a new tensor (for inspection and saving)."""
        return self.packed_weight.to_dense()

    @property
    def nbytes(self) -> int:
        return self.packed_weight.numel() * self.packed_weight.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # (..., in) -> (M, in)
        if self.row_tile is not None:
            return self._in_tiles(rows).reshape(*x.shape[:-1], self.out_features)
        lone = self.single_row_as_two and rows.shape[0] == 1
        if lone:  # batch invariance: the kernel oneDNN runs for two rows or more, and the first result kept
            rows = rows.expand(2, -1).contiguous()  # (1, in) -> (2, in): the row twice
        if torch.compiler.is_compiling():  # traced: the operator (eager, its dispatch would cost 5-10 us a call)
            out = packed_linear(rows, self.packed_weight, self.bias)  # (M, out)
        else:
            out = torch.ops.mkldnn._linear_pointwise(rows, self.packed_weight, self.bias, "none", [], "")
        return (out[:1] if lone else out).reshape(*x.shape[:-1], self.out_features)

    def _in_tiles(self, rows: torch.Tensor) -> torch.Tensor:
        """rows (M, in) -> (M, out), in products of exactly row_tile rows each (the last padded with zeros)."""
        tile = self.row_tile
        assert tile is not None
        outs = []
        for start in range(0, rows.shape[0], tile):
            part = rows[start : start + tile]
            if part.shape[0] < tile:
                part = torch.cat([part, part.new_zeros(tile - part.shape[0], self.in_features)])  # (tile, in)
            outs.append(torch.ops.mkldnn._linear_pointwise(part, self.packed_weight, self.bias, "none", [], ""))
        out = torch.cat(outs) if len(outs) > 1 else outs[0]  # (tiles * tile, out)
        return out[: rows.shape[0]]

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = self.weight  # loadable into an unpacked model

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class FusedPackedLinear(PackedLinear):
    """Linears that read the same input, packed as one (q, k and v; gate and up): one matrix multiply whose
    output columns are the parts' side by side, split by `part_sizes`. At one row a decode step's small
    projections are dominated by the call, not the arithmetic: on the CI machine in bfloat16, q, k and v took
    0.086 ms as three calls and 0.052 ms as one; gate and up 0.079 and 0.052 ms. The state dict still holds
    the parts under their own names (`q_proj.weight`, ...), loadable into an unpacked model."""

    def __init__(self, parts: dict[str, nn.Linear], rows_hint: int = PACKING_ROWS_HINT) -> None:
        linears = list(parts.values())
        has_bias = linears[0].bias is not None
        fused = nn.Linear(linears[0].in_features, sum(m.out_features for m in linears), bias=has_bias,
                          device=linears[0].weight.device, dtype=linears[0].weight.dtype)
        with torch.no_grad():
            fused.weight.copy_(torch.cat([m.weight for m in linears]))  # (sum of outs, in)
            if has_bias:
                fused.bias.copy_(torch.cat([m.bias for m in linears]))
        super().__init__(fused, rows_hint)
        self.part_names = tuple(parts)
        self.part_sizes = tuple(m.out_features for m in linears)

    def _in_tiles(self, rows: torch.Tensor) -> torch.Tensor:
        """rows (M, in) -> (M, out), in products of exactly row_tile rows each (the last padded with zeros)."""
        tile = self.row_tile
        assert tile is not None
        outs = []
        for start in range(0, rows.shape[0], tile):
            part = rows[start : start + tile]
            if part.shape[0] < tile:
                part = torch.cat([part, part.new_zeros(tile - part.shape[0], self.in_features)])  # (tile, in)
            outs.append(torch.ops.mkldnn._linear_pointwise(part, self.packed_weight, self.bias, "none", [], ""))
        out = torch.cat(outs) if len(outs) > 1 else outs[0]  # (tiles * tile, out)
        return out[: rows.shape[0]]

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        parent = prefix[: prefix.rstrip(".").rfind(".") + 1]  # "...self_attn.qkv_proj." -> "...self_attn."
        biases = self.bias.detach().split(self.part_sizes) if self.bias is not None else [None] * len(self.part_sizes)
        for name, weight, bias in zip(self.part_names, self.weight.split(self.part_sizes), biases):
            destination[f"{parent}{name}.weight"] = weight
            if bias is not None:
                destination[f"{parent}{name}.bias"] = bias

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, parts={dict(zip(self.part_names, self.part_sizes))}"


def _fuse_projections_(model: nn.Module, rows_hint: int) -> list[str]:
    """Pack each group a module declares in `FUSED_PROJECTIONS` ({"qkv_proj": ("q_proj", "k_proj", "v_proj")})
    as one `FusedPackedLinear` under the group's name, removing the parts; returns the fused modules' names."""
    fused = []
    for name, module in list(model.named_modules()):
        for group, part_names in getattr(module, "FUSED_PROJECTIONS", {}).items():
            parts = {part: getattr(module, part, None) for part in part_names}
            if not all(isinstance(m, nn.Linear) for m in parts.values()):
                continue
            if len({m.bias is None for m in parts.values()}) > 1:  # some with a bias, some without: not fused
                continue
            setattr(module, group, FusedPackedLinear(parts, rows_hint))  # type: ignore[arg-type]
            for part in part_names:
                delattr(module, part)
            fused.append(f"{name}.{group}" if name else group)
    return fused


def pack_linears_(model: nn.Module, rows_hint: int = PACKING_ROWS_HINT) -> list[str]:
    """Replace, in place, every `nn.Linear` of `model` by a `PackedLinear`, the groups its modules declare
    (`FUSED_PROJECTIONS`) by one `FusedPackedLinear` each; returns the names of the layers packed (none if
    it was packed before). Raises ValueError where packing does not apply (`packing_unsupported_reason`)."""
    reason = packing_unsupported_reason(model)
    if reason is not None:
        raise ValueError(reason)
    packed = _fuse_projections_(model, rows_hint)
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear):
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, PackedLinear(module, rows_hint))
            packed.append(name)
    return packed


def is_packed(model: nn.Module) -> bool:
    """Whether any of the model's linear layers runs on packed weights."""
    return any(isinstance(m, PackedLinear) for m in model.modules())
