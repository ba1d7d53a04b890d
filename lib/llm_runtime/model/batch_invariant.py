"""Batch invariance (lesson 16): a row's logits bitwise independent of the rows computed beside it.

Floating-point addition is not associative, so a result depends on the order of its sums. A row of a batch
goes through the same arithmetic alone or beside others only where every kernel reduces it in an order that
does not depend on the batch. Measured on this package's CPU in bfloat16 (tests/engine/test_batch_invariance.py
checks the outcome end to end):

- oneDNN's matrix multiply gives every row of a product with two or more rows the same bits, whatever the
  number of rows (2 to 2,048) and the row's place; one row alone goes through another kernel (a matrix-vector
  product) whose sums round otherwise, about 1 output in 10,000. So a lone row is multiplied as two
  (`PackedLinear.single_row_as_two`): measured 1.1-1.3x the time of one row's product, in steps that compute a
  single row (a decode at batch 1) only.
- RMSNorm, rotary and SiLU-and-multiply work row by row, and the sampler's softmax too: invariant as they are.
- Attention: the C kernel (attention/cpu_kernels.py) walks one query row's keys in chunks of 16 in order, the
  same for a decode and for a prefill chunk's row at the same position; the block-wise path, which long chunks
  take by default, tiles by the chunk's shape. So every row goes to the kernel.
- torch.compile generates its own kernels per shape: off.

`batch_invariant_unsupported_reason` says where this is not available; `make_batch_invariant_` sets it up.
"""

from __future__ import annotations

from torch import nn

from .packed_linear import PackedLinear, packing_unsupported_reason


def batch_invariant_unsupported_reason(model: nn.Module) -> str | None:
    """None when batch-invariant mode runs for this model here; otherwise why not."""
    device = next(model.parameters()).device
    if device.type != "cpu":
        return f"batch_invariant=True runs on the CPU so far, not {device.type}"
    reason = packing_unsupported_reason(model)
    return f"batch_invariant=True needs packed linear layers, and {reason}" if reason is not None else None


def make_batch_invariant_(model: nn.Module) -> int:
    """Every packed linear layer of `model` multiplies a lone row as two (in place, lasting); returns how many.
    A row's result is then the one it gets in any larger product: nothing else the model computes changes."""
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    for module in packed:
        module.single_row_as_two = True
    return len(packed)
