"""Batch invariance (lesson 16): a row's logits bitwise independent of the rows computed beside it.

Floating-point addition is not associative, so a result depends on the order of its sums. A row of a batch
goes through the same arithmetic alone or beside others only where every kernel reduces it in an order that
does not depend on the batch.

On the CPU, measured in bfloat16 and float32 (tests/engine/test_batch_invariance.py checks the outcome end to end):

- oneDNN's matrix multiply, on a CPU without usable AMX (and in float32 everywhere measured), gives every row of
  a product with two or more rows the same bits, whatever the number of rows (2 to 2,048) and the row's place;
  one row alone goes through another kernel (a matrix-vector product) whose sums round otherwise, about 1 output
  in 10,000. So a lone row is multiplied as two (`PackedLinear.single_row_as_two`): measured 1.1-1.3x the time of
  one row's product, in steps that compute a single row (a decode at batch 1) only.
- Where the CPU lets oneDNN use AMX, its bfloat16 kernels change with the number of rows (a product of 2, 7 or
  256 rows gives a row other bits: measured on this course's VM, the day it allowed AMX), while products of one
  fixed size agree. There every product is made in calls of exactly `row_tile` rows, the last padded
  (`PackedLinear.row_tile`). Which of the two holds is measured, not assumed: `make_batch_invariant_` probes each
  shape of linear the model has (`_probe`), takes the lone-row rule where it is invariant, else the first tile
  of 32, 16 or 64 rows that is (`ROW_TILES`), and refuses when none is.
- RMSNorm, rotary and SiLU-and-multiply work row by row, and the sampler's softmax too: invariant as they are.
- Attention: the C kernel (attention/cpu_kernels.py) walks one query row's keys in chunks of 16 in order, the
  same for a decode and for a prefill chunk's row at the same position; the block-wise path, which long chunks
  take by default, tiles by the chunk's shape. So every row goes to the kernel (`AttentionBackend.batch_invariant`).

On CUDA the library kernels are not relied on at all (cuBLAS picks a kernel, and may split K, by shape; a CUDA
reduction may split a row over thread blocks when there are few rows):

- every nn.Linear becomes an `InvariantLinear`, the fixed-tile Triton matrix multiply of invariant_matmul.py;
- RMSNorm is the one-program-per-row Triton kernel of invariant_norm.py (`INVARIANT_OPS`);
- attention is the `triton` backend's unified kernel with a fixed tile of query rows and never split-KV, so a
  row's keys are walked in steps of 32 from the first, the same in a decode and in a prefill chunk;
- embedding, rotary, SiLU-and-multiply and the residual adds are elementwise; the sampler's log-softmax over
  the vocabulary takes one thread block per row whatever the batch.
The CUDA path has been run under Triton's interpreter on the CPU (its tests) and reviewed, not yet on a GPU:
the GPU-marked tests at the end of tests/engine/test_batch_invariance_triton.py are its matrix.

Quantized layers (int8, int4, the GGUF's Q8_0 head) are refused: their kernels have not been checked row by row.
torch.compile generates its own kernels per shape, and CUDA graphs are not used with this mode: both off.

`batch_invariant_unsupported_reason` says where this is not available; `make_batch_invariant_` sets it up.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence

import torch
from torch import nn


from .packed_linear import PackedLinear, packing_unsupported_reason
from .quantized_embedding import Q8Head
from .quantized_linear import Int4Linear, Int8GroupLinear, Int8Linear

QUANTIZED = (Int8Linear, Int8GroupLinear, Int4Linear, Q8Head)


def batch_invariant_unsupported_reason(model: nn.Module, triton: bool | None = None) -> str | None:
    """None when batch-invariant mode runs for this model here; otherwise why not. `triton`: with the Triton
    kernels (None: on CUDA, as the engine does; on the CPU they run under Triton's interpreter, for tests)."""
    quantized = sorted({type(m).__name__ for m in model.modules() if isinstance(m, QUANTIZED)})
    if quantized:
        return (f"batch_invariant=True does not run quantized layers ({', '.join(quantized)}): their kernels have "
                f"not been checked row by row; load the model unquantized")
    device = next(model.parameters()).device
    if triton is None:
        triton = device.type == "cuda"
    if triton:
        if importlib.util.find_spec("triton") is None:
            return "batch_invariant=True on CUDA runs Triton kernels, and triton is not installed"
        if any(isinstance(m, PackedLinear) for m in model.modules()):
            return ("batch_invariant=True with Triton kernels multiplies nn.Linear weights, and this model's are "
                    "packed for oneDNN (by an earlier engine): load it again")
        return None
    if device.type != "cpu":
        return f"batch_invariant=True runs on the CPU and CUDA, not {device.type}"
    reason = packing_unsupported_reason(model)
    return f"batch_invariant=True needs packed linear layers, and {reason}" if reason is not None else None


def make_batch_invariant_(model: nn.Module, triton: bool | None = None) -> int:
    """Set `model` up for batch invariance, in place and lasting; returns how many linear layers it changed.
    On the CPU every packed linear multiplies a lone row as two (a row's result is then the one it gets in any
    larger product); with `triton` (None: on CUDA) every linear and RMSNorm becomes a Triton kernel with a fixed
    reduction order."""
    if triton is None:
        triton = next(model.parameters()).device.type == "cuda"
    if triton:
        return make_triton_invariant_(model)
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    rules: dict[tuple, tuple[bool, int | None]] = {}
    for module in packed:
        shape = (module.in_features, module.out_features, module.packed_weight.dtype)
        if shape not in rules:
            rules[shape] = _probe(module)
        module.single_row_as_two, module.row_tile = rules[shape]
    return len(packed)


def rows_invariant(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                   chunk_sizes: Sequence[int] = (1, 2, 3, 7)) -> bool:
    """Whether fn (rows (M, ...) -> (M, ...), one output row per input row) gives every row of x the same bits
    when x is cut into chunks of each size in `chunk_sizes` (the last chunk may be shorter) as when x goes in
    whole."""
    whole = fn(x)
    for size in chunk_sizes:
        parts = torch.cat([fn(x[start : start + size]) for start in range(0, len(x), size)])
        if not torch.equal(parts, whole):
            return False
    return True


# Tiles tried in this order: 32 first, as 48 requests x 24 tokens of the bundled model in bfloat16 ran at 565-607
# tok/s in calls of 32 rows against 451-541 in calls of 16, and 578-592 in calls of 64 (AMX, 2 cores, alternated).
PROBE_ROWS, PROBE_SPLITS, ROW_TILES = 70, (1, 2, 3, 7, 16, 33), (32, 16, 64)


def _probe(module: PackedLinear) -> tuple[bool, int | None]:
    """(single_row_as_two, row_tile) that make this linear's rows invariant here (module docstring): the lone-row
    rule if the product's rows agree for every split of PROBE_ROWS random rows, else the first row tile (ROW_TILES)
    that does. ValueError when neither does (a CPU or library this mode has not met)."""
    x = torch.randn(PROBE_ROWS, module.in_features, generator=torch.Generator().manual_seed(16))
    x = x.to(module.packed_weight.dtype)
    with torch.inference_mode():
        for rule in [(True, None)] + [(False, tile) for tile in ROW_TILES]:
            module.single_row_as_two, module.row_tile = rule
            if rows_invariant(module, x, PROBE_SPLITS):
                return rule
    raise ValueError(f"batch_invariant=True: no way measured here makes a {module.in_features} x "
                     f"{module.out_features} {module.packed_weight.dtype} linear's rows invariant on this CPU")


def make_triton_invariant_(model: nn.Module) -> int:
    """Linears through the invariant Triton matrix multiply, RMSNorm through the per-row kernel (in place);
    returns how many linears changed. The CPU runs them under TRITON_INTERPRET=1 (slowly: for tests)."""
    from .invariant_matmul import make_linears_invariant_
    from .invariant_norm import INVARIANT_OPS
    from .pointwise import set_pointwise_ops_

    set_pointwise_ops_(model, INVARIANT_OPS)
    return make_linears_invariant_(model)
