"""Batch invariance by hand (lesson 16): a sum taken in blocks, as a split-K product or a split-KV attention
adds, and a probe of whether a row-wise function gives each row the same bits whatever rows come with it.

    blocked_sum([1e8, 1.0, -1e8, 1.0], block=2)       # float32: the blocks' sums, then their sum in order
    rows_invariant(lambda rows: linear(rows), x)       # True when every row's bits survive every split of x
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..model.batch_invariant import rows_invariant  # the engine's own probe (re-exported for the lesson)


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
