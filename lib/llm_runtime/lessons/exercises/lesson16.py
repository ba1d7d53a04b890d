"""Lesson 16 exercises: a sum in blocks, and a probe for batch invariance.

- `blocked_sum(values, block)`: the float32 sum a split reduction computes (blocks summed in order, then their
  partial sums), against `lessons.invariance.blocked_sum`.
- `rows_invariant(fn, x, chunk_sizes)`: whether a row-wise function gives every row the same bits in every
  split of its input, against `lessons.invariance.rows_invariant`.
"""

from __future__ import annotations

import random

import torch

from ..invariance import blocked_sum as reference_blocked_sum
from ..invariance import rows_invariant as reference_rows_invariant
from .check import Case, Verdict, run_cases, same_value


def check_blocked_sum(fn: object) -> Verdict:
    """`blocked_sum(values, block) -> float`: in float32 (numpy.float32 or a float32 tensor; each value converted
    to float32 first), sum each run of `block` values left to right, starting from 0, then add those partial sums
    left to right, starting from 0. Return the total as a Python float."""

    def cases() -> list[Case]:
        rng = random.Random(16)
        inputs = [([1e8, 1.0, -1e8, 1.0], 4, "one block: the 1.0 next to 1e8 is lost"),
                  ([1e8, 1.0, -1e8, 1.0], 2, "two blocks: a different answer"),
                  ([1e8, 1.0, -1e8, 1.0], 1, "blocks of one"),
                  ([0.1] * 10, 3, "a last block shorter than the others"), ([], 4, "nothing to add"),
                  ([2.5], 8, "one value")]
        for _ in range(30):
            values = [rng.uniform(-1, 1) * 10 ** rng.randint(-3, 6) for _ in range(rng.randint(2, 40))]
            inputs.append((values, rng.randint(1, 12), ""))
        return [Case({"values": values, "block": block}, reference_blocked_sum(values, block), note)
                for values, block, note in inputs]

    return run_cases("blocked_sum", fn, cases, same_value, "llm_runtime.lessons.invariance.blocked_sum")


def _row_functions() -> list[tuple[str, object]]:
    """Row-wise functions, invariant or not, to probe (each deterministic, on the CPU)."""
    weight = torch.randn(24, 40, generator=torch.Generator().manual_seed(16))

    def per_row_sum(rows: torch.Tensor) -> torch.Tensor:
        return rows.sum(dim=1, keepdim=True)  # each row alone

    def scaled_by_the_batch(rows: torch.Tensor) -> torch.Tensor:
        return rows / len(rows)  # depends on how many rows came: not invariant

    def centred_on_the_batch(rows: torch.Tensor) -> torch.Tensor:
        return rows - rows.mean(dim=0, keepdim=True)  # depends on the other rows' values

    def blocked_when_alone(rows: torch.Tensor) -> torch.Tensor:
        # A kernel choice by row count: one row summed in blocks of 8, more rows left to right.
        if len(rows) == 1:
            return torch.stack([torch.stack([c.sum() for c in rows[0].split(8)]).sum()]).reshape(1, 1)
        return torch.stack([torch.stack(list(row)).cumsum(0)[-1] for row in rows]).reshape(-1, 1)

    def nudged_when_alone(rows: torch.Tensor) -> torch.Tensor:
        return rows + rows * 2**-20 if len(rows) == 1 else rows  # a last-bit change for a lone row

    def linear_in_float64(rows: torch.Tensor) -> torch.Tensor:
        return (rows.double() @ weight.double().T).float()

    return [("per_row_sum", per_row_sum), ("scaled_by_the_batch", scaled_by_the_batch),
            ("centred_on_the_batch", centred_on_the_batch), ("blocked_when_alone", blocked_when_alone),
            ("nudged_when_alone", nudged_when_alone),
            ("linear_in_float64", linear_in_float64)]


def check_rows_invariant(fn: object) -> Verdict:
    """`rows_invariant(fn, x, chunk_sizes) -> bool`: fn maps rows (M, ...) to one output row each. True when,
    for every size in chunk_sizes, fn over x cut into chunks of that size (the last may be shorter), the
    outputs concatenated, equals fn(x) bitwise (torch.equal); else False."""

    def cases() -> list[Case]:
        generator = torch.Generator().manual_seed(16)
        out = []
        for name, function in _row_functions():
            for rows, sizes in [(9, (1, 2, 3, 7)), (6, (6,)), (5, (2,))]:
                x = torch.randn(rows, 40, generator=generator) * 100
                out.append(Case({"fn": function, "x": x, "chunk_sizes": sizes},
                                reference_rows_invariant(function, x, sizes), name))
        return out

    return run_cases("rows_invariant", fn, cases, same_value, "llm_runtime.lessons.invariance.rows_invariant")
