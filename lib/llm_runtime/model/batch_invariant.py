"""Batch invariance (lesson 16): a row's logits bitwise independent of the rows computed beside it.

Floating-point addition is not associative, so a result depends on the order of its sums. A row of a batch
goes through the same arithmetic alone or beside others only where every kernel reduces it in an order that
does not depend on the batch.

On the CPU, measured in bfloat16 and float32 (tests/engine/test_batch_invariance.py checks the outcome end to end):

- oneDNN's matrix multiply gives every row of a product with two or more rows the same bits, whatever the
  number of rows (2 to 2,048) and the row's place; one row alone goes through another kernel (a matrix-vector
  product) whose sums round otherwise, about 1 output in 10,000. So a lone row is multiplied as two
  (`PackedLinear.single_row_as_two`): measured 1.1-1.3x the time of one row's product, in steps that compute a
  single row (a decode at batch 1) only.
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
tests/engine/test_batch_invariance_cuda.py is the GPU-marked matrix.

Quantized layers (int8, int4, the GGUF's Q8_0 head) are refused: their kernels have not been checked row by row.
torch.compile generates its own kernels per shape, and CUDA graphs are not used with this mode: both off.

`batch_invariant_unsupported_reason` says where this is not available; `make_batch_invariant_` sets it up.
"""

from __future__ import annotations

import importlib.util

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
    for module in packed:
        module.single_row_as_two = True
    return len(packed)


def make_triton_invariant_(model: nn.Module) -> int:
    """Linears through the invariant Triton matrix multiply, RMSNorm through the per-row kernel (in place);
    returns how many linears changed. The CPU runs them under TRITON_INTERPRET=1 (slowly: for tests)."""
    from .invariant_matmul import make_linears_invariant_
    from .invariant_norm import INVARIANT_OPS
    from .pointwise import set_pointwise_ops_

    set_pointwise_ops_(model, INVARIANT_OPS)
    return make_linears_invariant_(model)
