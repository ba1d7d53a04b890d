"""Batch invariance by hand (lesson 16): a sum taken in blocks, as a split-K product or a split-KV attention
adds, and a probe of whether a row-wise function gives each row the same bits whatever rows come with it.

    blocked_sum([1e8, 1.0, -1e8, 1.0], block=2)       # float32: the blocks' sums, then their sum in order
    rows_invariant(lambda rows: linear(rows), x)       # True when every row's bits survive every split of x
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch


def blocked_sum(values: Sequence[float], block: int) -> float:
    """The float32 sum of `values` taken as a split reduction does: each run of `block` values summed left to
    right, then those partial sums added left to right (block >= len(values): one plain left-to-right sum)."""
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    data = np.asarray(values, dtype=np.float32)
    partials = []
    for start in range(0, len(data), block):
        total = np.float32(0.0)
        for value in data[start : start + block]:
            total = np.float32(total + value)
        partials.append(total)
    total = np.float32(0.0)
    for partial in partials:
        total = np.float32(total + partial)
    return float(total)


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
