"""Linear layers with quantized weights: int8 per output channel, int4 in groups (lesson 13).

A decode step reads every weight once, so at small batch its time is the weights' bytes over the
memory bandwidth. Fewer bits per weight is the most direct speed-up there is: PyTorch ships matrix
multiplies that read quantized weights and de-quantize them in registers.

- **int8, per output channel** (`Int8Linear`, `torch._weight_int8pack_mm`): row n of W is
  `scale[n] * q[n]` with q in [-127, 127] and scale = max |W[n]| / 127 (symmetric: zero stays 0).
- **int8, in groups of 32 with a zero** (`Int8GroupLinear`, this package's C kernel for the GGUF's Q8_0
  table with a minimum added, `quantized_embedding.py`): each run of 32 input columns of a row has its own
  scale and zero, `W = q * scale + zero`, the group's range in 255 steps (scale = (max - min) / 255: both
  ends land on the grid) or, where that rounds less, symmetric about zero (scale = max |w| / 127). The
  first holds any 4-bit group's 16 levels exactly, the second any Q8_0 block: on the bundled model, whose
  layers were Q4_1 and its head Q8_0, nothing is rounded again.
- **int4, in groups** (`Int4Linear`, `torch._weight_int4pack_mm_for_cpu` on the CPU or this package's
  16-bit integer kernel where the CPU has AVX-512 VNNI, `torch._weight_int4pack_mm` on CUDA): each run of
  `group_size` input columns of a row has its own scale and zero, and `W = (q - 8) * scale + zero` with q
  in [0, 15] (asymmetric: the group's minimum and maximum are both representable). The kernels read the
  4-bit values from their own tiled layout (`_convert_weight_to_int4pack*`), two per byte.

A GGUF Q4_1 block (32 weights: a scale d, a minimum m, 32 four-bit values q, W = d * q + m) is
exactly such a group, with scale d and zero m + 8 d: `gguf.py` loads the bundled model's blocks
into `Int4Linear` without rounding anything again.

The kernels are fast with bfloat16 activations (on the 2-core CI CPU at one row: the bundled model's
head took 3.4 ms dense, 1.5 ms int8 and 0.75 ms int4) and slow in float32 (there the int4 head took
24 ms, dense 9.7 ms), so a quantized model computes in bfloat16 unless asked otherwise. At many rows
(a prefill, a large decode batch) they lose to a dense bfloat16 multiply (the head at 64 rows: 11 ms
dense, 43 ms int8, 22 ms int4). So on the CPU an int4 layer above `DENSE_ROWS` rows, or in float32,
turns its weight back into the compute dtype with this package's C kernel (`quantized_kernels.py`,
reading PyTorch's own packing: no second copy is kept) and multiplies densely. At a few rows in bfloat16,
on a CPU with AVX-512 VNNI, another of its kernels multiplies the 4-bit values as 16-bit integers, 1.3x
PyTorch's int4 kernel at one row (the bundled model's native 4-bit decode step: 8.4-9.4 ms against
9.4-10.2 ms, against float32's 29.7-32.2 ms, six runs with the three engines in turn).
"""

from __future__ import annotations

import torch
from torch import nn

from ..native.cpp_operators import cpp_operator
from ..native.operators import define_operator
from .quantized_embedding import Q8Table
from .quantized_kernels import int4_dequantize_t, kernels_unavailable_reason
from .quantized_kernels import int4_matmul as int4_matmul_c

QUANTIZATIONS = ("int8", "int4", "gguf")
INT4_GROUP_SIZES = (32, 64, 128, 256)
_INNER_K_TILES = 2  # the int4 kernels' tiling of the input dimension (K must be a multiple of 16 x this)
_ROW_MULTIPLE = 16  # ... and of the output dimension
# On the CPU, above this many rows a layer turns its weight back into the compute dtype (a C kernel
# reading PyTorch's packing, quantized_kernels.py) and multiplies densely: at 64 rows and 3072 x 576 that
# took 0.89 ms against PyTorch's int4 kernel's 1.36 ms in bfloat16 here (2.55 against 5.50 ms at 256 rows);
# at 32 rows the two are even, and below it the int4 kernel wins (0.07 against 0.36 ms at one row). This
# package's int4 kernel, where the CPU has it, keeps winning a little further (at 32 rows 0.38 ms against
# the dense 0.59 ms, at 48 rows 0.55 against 0.63, at 64 rows 0.81 against 0.66), but one threshold for
# both keeps PyTorch's kernel out of the rows where it loses by 2x.
DENSE_ROWS = 32


# ------------------------------------------------------------------------------------ the arithmetic
def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, in) -> q (out, in) int8 in [-127, 127], scale (out,) float32: weight ~ scale[:, None] * q."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127  # (out,)
    q = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[:, None]


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, in) -> q (out, in) int32 in [0, 15], scale and zero (out, in / group_size) float32:
    weight ~ (q - 8) * scale + zero within each group of `group_size` input columns."""
    out_features, in_features = weight.shape
    groups = _groups(weight, group_size)  # (out, G, group)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)  # (out, G)
    scale = (high - low).clamp(min=1e-12) / 15
    q = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32)
    return q.reshape(out_features, in_features), scale, low + 8 * scale


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return _dequantized_groups(q.float() - 8, scale, zero)


def _groups(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """(out, in) -> (out, in / group_size, group_size) float32: each row's runs of `group_size` input columns."""
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise ValueError(f"in_features {in_features} is not a multiple of the group size {group_size}")
    return weight.float().reshape(out_features, in_features // group_size, group_size)


def _dequantized_groups(levels: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """levels (out, in) float, scale and zero (out, G) -> levels * scale + zero per group: (out, in) float32."""
    out_features, in_features = levels.shape
    groups = levels.reshape(out_features, scale.shape[1], -1)  # (out, G, group)
    return (groups * scale[..., None] + zero[..., None]).reshape(out_features, in_features)


INT8_GROUP = 32  # the grouped int8 layers' group: the Q8_0 table's block


def quantize_int8_groups(weight: torch.Tensor, group_size: int = INT8_GROUP
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, in) -> q (out, in) int8, scale and zero (out, in / group_size) float32: weight ~ q * scale + zero
    within each group. Each group takes the better (smaller squared error) of two grids: its range in 255
    steps (scale = (max - min) / 255, zero = min + 128 * scale, q in [-128, 127]), or symmetric about zero
    (scale = max |w| / 127, zero = 0, q in [-127, 127]). The first holds any 4-bit group's 16 levels exactly
    (a Q4_1 block), the second any Q8_0 block: weights that were already quantized are not rounded again."""
    out_features, in_features = weight.shape
    groups = _groups(weight, group_size)  # (out, G, group)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)  # (out, G)
    ranged = (high - low).clamp(min=1e-12) / 255
    ranged_q = ((groups - low[..., None]) / ranged[..., None]).round().clamp(0, 255) - 128
    ranged_zero = low + 128 * ranged
    symmetric = groups.abs().amax(dim=-1).clamp(min=1e-12) / 127
    symmetric_q = (groups / symmetric[..., None]).round().clamp(-127, 127)

    def squared_error(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        return ((q * scale[..., None] + zero[..., None] - groups) ** 2).sum(-1)  # (out, G)

    use_symmetric = squared_error(symmetric_q, symmetric, torch.zeros_like(symmetric)) < \
        squared_error(ranged_q, ranged, ranged_zero)
    q = torch.where(use_symmetric[..., None], symmetric_q, ranged_q)
    scale = torch.where(use_symmetric, symmetric, ranged)
    zero = torch.where(use_symmetric, torch.zeros_like(ranged_zero), ranged_zero)
    return q.to(torch.int8).reshape(out_features, in_features), scale, zero


def dequantize_int8_groups(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return _dequantized_groups(q.float(), scale, zero)


# ------------------------------------------------------------------------------------ the layers
class Int8Linear(nn.Module):
    """y = x (scale * q)^T + b, with q int8 (out, in) and one scale per output channel."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                 part_sizes: tuple[int, ...] | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.register_buffer("q", q.contiguous())
        self.register_buffer("scale", scale.to(dtype))
        self.register_buffer("bias", None if bias is None else bias.to(dtype))
        self.part_sizes = part_sizes  # the output widths of the layers fused into this one, if any

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, *, dtype: torch.dtype,
                    part_sizes: tuple[int, ...] | None = None) -> "Int8Linear":
        q, scale = quantize_int8(weight)
        return cls(q.to(weight.device), scale.to(weight.device), bias, dtype, part_sizes)

    def dequantized(self) -> torch.Tensor:
        """The weight the layer multiplies by, (out, in) float32."""
        return dequantize_int8(self.q, self.scale.float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # (..., in) -> (M, in)
        out = torch.ops.aten._weight_int8pack_mm(rows, self.q, self.scale.to(x.dtype))
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per channel"


class Int8GroupLinear(nn.Module):
    """y = x W^T + b, W = q * scale + zero per group of 32 input columns, q int8, held as a block-major table
    (`Q8Table` with a minimum) that the C kernels read in one pass at a few rows and turn back a tile of rows
    at a time at many."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bias: torch.Tensor | None,
                 dtype: torch.dtype, part_sizes: tuple[int, ...] | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.table = Q8Table(q, scale, dtype, m=zero)
        self.register_buffer("bias", None if bias is None else bias.to(dtype))
        self.part_sizes = part_sizes

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, *, dtype: torch.dtype,
                    part_sizes: tuple[int, ...] | None = None) -> "Int8GroupLinear":
        q, scale, zero = quantize_int8_groups(weight)
        return cls(q, scale, zero, bias, dtype, part_sizes)

    def dequantized(self) -> torch.Tensor:
        """The weight the layer multiplies by, (out, in) float32."""
        return self.table.rows(torch.arange(self.out_features, device=self.table.q.device)).float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.table.matmul_t(x.reshape(-1, self.in_features))  # (..., in) -> (M, out)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"int8 in groups of {INT8_GROUP} with a zero")


class Int4Linear(nn.Module):
    """y = x W^T + b, W = (q - 8) * scale + zero per group of `group_size` input columns, q 4-bit, held in
    the int4 kernels' packed layout (two values a byte)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bias: torch.Tensor | None,
                 dtype: torch.dtype, part_sizes: tuple[int, ...] | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.group_size = self.in_features // scale.shape[1]
        if self.in_features % (16 * _INNER_K_TILES):
            raise ValueError(f"int4 layers need in_features a multiple of {16 * _INNER_K_TILES}, got {self.in_features}")
        pad = -self.out_features % _ROW_MULTIPLE  # the kernels take whole tiles of rows: padded with zeros
        q, scale, zero = (nn.functional.pad(t, (0, 0, 0, pad)) for t in (q.to(torch.int32), scale, zero))
        self.register_buffer("packed", _pack_int4(q))
        # (G, out + pad, 2): each group's scale and zero, as the kernels read them
        self.register_buffer("scales_and_zeros", torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
                             .to(dtype))
        self.register_buffer("bias", None if bias is None else bias.to(dtype))
        self.part_sizes = part_sizes

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, *, dtype: torch.dtype,
                    group_size: int = 32, part_sizes: tuple[int, ...] | None = None) -> "Int4Linear":
        q, scale, zero = quantize_int4(weight, group_size)
        return cls(q, scale, zero, bias, dtype, part_sizes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # (..., in) -> (M, in)
        product = int4_product
        if torch.compiler.is_compiling():  # traced: one operator, the C++ one where it is loaded
            product = (cpp_operator("int4_matmul") if x.device.type == "cpu" else None) or int4_matmul
        out = product(rows, self.packed, self.group_size, self.scales_and_zeros.to(x.dtype))
        out = out[:, : self.out_features]  # drop the padding rows' outputs
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"int4 in groups of {self.group_size}")


def int4_product(rows: torch.Tensor, packed: torch.Tensor, group_size: int,
                 scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """rows (M, K) @ W^T -> (M, N padded) for a weight in the int4 kernels' packing, by the kernel that
    suits M: at a few rows this package's int4 kernel (bfloat16 on a CPU with AVX-512 VNNI) or PyTorch's,
    the weight turned back for a dense product at many."""
    if _dense_here(rows, packed):  # the weight back in rows' dtype, then the dense product
        return rows @ int4_dequantize_t(packed, scales_and_zeros, rows.shape[1], group_size)
    if packed.device.type == "cuda":
        return torch.ops.aten._weight_int4pack_mm(rows, packed, group_size, scales_and_zeros)
    if kernels_unavailable_reason() is None:
        out = int4_matmul_c(rows, packed, group_size, scales_and_zeros)
        if out is not None:
            return out
    return torch.ops.aten._weight_int4pack_mm_for_cpu(rows, packed, group_size, scales_and_zeros)


# `int4_product` as one operator for torch.compile (worker/compiled_forward.py): the tracer cannot see into
# the C kernel, and the choice by row count stays inside, so one graph serves every row count.
int4_matmul = define_operator("int4_matmul", int4_product, dispatch_keys=("CPU", "CUDA"))


@torch.library.register_fake("llm_runtime::int4_matmul")
def int4_matmul_fake(rows: torch.Tensor, packed: torch.Tensor, group_size: int,
                     scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """The output's shape and dtype, for tracing (also the C++ twin's, native/cpp_operators.py)."""
    return rows.new_empty(rows.shape[0], scales_and_zeros.shape[1])  # (M, N padded)


def _dense_here(rows: torch.Tensor, packed: torch.Tensor) -> bool:
    """On the CPU, more than DENSE_ROWS rows (or float32 at any count, where PyTorch's int4 kernel is
    slow) run as a dense product over the weight turned back by the C kernel, where it builds."""
    return (packed.device.type == "cpu" and (rows.shape[0] > DENSE_ROWS or rows.dtype == torch.float32)
            and kernels_unavailable_reason() is None)


def _pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q (out, in) int32 in [0, 15] -> the int4 kernels' packed layout on q's device."""
    if q.device.type == "cuda":  # the CUDA kernel takes two values a byte, the even column in the high nibble
        pairs = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)  # (out, in / 2)
        return torch.ops.aten._convert_weight_to_int4pack(pairs, _INNER_K_TILES)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), _INNER_K_TILES)



# ------------------------------------------------------------------------------------ a model's linears
def quantize_linears_(model: nn.Module, method: str, *, group_size: int | None = None,
                      dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """Replace, in place, the model's linear layers (the LM head included) by quantized ones computing in
    `dtype`; the groups its modules declare (`FUSED_PROJECTIONS`: q/k/v, gate/up) become one layer each.
    `group_size`: int4's group (default 32); for int8, None is one scale per output channel and 32 groups of
    32 columns with a zero. Returns the names of the new layers. A head tied to the embedding gets its own
    quantized copy."""
    if method not in ("int8", "int4"):
        raise ValueError(f"quantization must be 'int8' or 'int4' here, got {method!r}")
    if method == "int4":
        group_size = 32 if group_size is None else group_size
        if group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"int4 group_size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    if method == "int8" and group_size not in (None, INT8_GROUP):
        raise ValueError(f"int8 group_size must be None (per output channel) or {INT8_GROUP}, got {group_size}")

    def make(weight: torch.Tensor, bias: torch.Tensor | None, part_sizes: tuple[int, ...] | None) -> nn.Module:
        if method == "int8" and group_size is not None:
            return Int8GroupLinear.from_weight(weight, bias, dtype=dtype, part_sizes=part_sizes)
        if method == "int8":
            return Int8Linear.from_weight(weight, bias, dtype=dtype, part_sizes=part_sizes)
        return Int4Linear.from_weight(weight, bias, dtype=dtype, group_size=group_size, part_sizes=part_sizes)

    done = []
    with torch.no_grad():
        for name, module in list(model.named_modules()):
            for group, part_names in getattr(module, "FUSED_PROJECTIONS", {}).items():
                parts = [getattr(module, part, None) for part in part_names]
                if not all(isinstance(p, nn.Linear) for p in parts) or len({p.bias is None for p in parts}) > 1:
                    continue
                weight = torch.cat([p.weight for p in parts])  # rows of the parts, one after another
                bias = None if parts[0].bias is None else torch.cat([p.bias for p in parts])
                setattr(module, group, make(weight, bias, tuple(p.out_features for p in parts)))
                for part in part_names:
                    delattr(module, part)
                done.append(f"{name}.{group}" if name else group)
        for name, module in list(model.named_modules()):
            if isinstance(module, nn.Linear):
                parent_name, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent_name), child, make(module.weight, module.bias, None))
                done.append(name)
    return done


def is_quantized(model: nn.Module) -> str | None:
    """The quantization of the model's linear layers ("int8", "int4"), or None."""
    for module in model.modules():
        if isinstance(module, (Int8Linear, Int8GroupLinear)):
            return "int8"
        if isinstance(module, Int4Linear):
            return "int4"
    return None
