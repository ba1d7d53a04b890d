"""Lesson 19 exercises: rounding where the operator path rounds, the rows of an int4 work item, and the items each
thread gets under OpenMP's static schedule.

- `silu_and_mul_bf16(gate, up)`: bfloat16 in and out, computed in float32 and rounded where the eager path's
  bfloat16 tensors are: bitwise against `model.pointwise.silu_and_mul` on bfloat16 tensors.
- `half_block_rows(item)`: against `lessons.decode_limit.half_block_rows`.
- `static_schedule(num_items, num_threads)`: against `lessons.decode_limit.static_schedule`.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from ...model.pointwise import silu_and_mul
from ..decode_limit import half_block_rows as reference_half_block_rows
from ..decode_limit import static_schedule as reference_static_schedule
from .check import Case, Verdict, method_verdict, run_cases, same_value
from .operators import record_operators


def _bitwise(expected: torch.Tensor, got: Any) -> str | None:
    if not isinstance(got, torch.Tensor):
        return f"expected a tensor, got {type(got).__name__}"
    if got.dtype != torch.bfloat16 or got.shape != expected.shape:
        return f"expected bfloat16 {tuple(expected.shape)}, got {got.dtype} {tuple(got.shape)}"
    differ = (expected.view(torch.int16) != got.view(torch.int16)).nonzero()
    if len(differ):
        i = tuple(differ[0].tolist())
        return (f"{len(differ)} of {expected.numel()} values differ in their bits, first at {i}: "
                f"{expected[i].item()!r} expected, {got[i].item()!r} got")
    return None


def check_silu_and_mul_bf16(fn: object) -> Verdict:
    """`silu_and_mul_bf16(gate, up) -> Tensor`: gate and up bfloat16 of one shape; silu(gate) * up in bfloat16,
    computed in float32 and rounded to bfloat16 where the eager path has a bfloat16 tensor: after silu, then after
    the product. Bit for bit the eager path's, as the native step's C code must be; arithmetic on bfloat16 tensors
    (the eager expression itself) fails however right its bits."""

    def cases() -> list[Case]:
        generator = torch.Generator().manual_seed(19)
        out = []
        for shape, scale, note in [((4, 1536), 3.0, "a decode batch's MLP activations"), ((1, 64), 1.0, ""),
                                   ((8, 96), 20.0, "large gates: silu is the identity there, the product rounds"),
                                   ((3, 32), 0.01, "small gates")]:
            gate = (torch.randn(shape, generator=generator) * scale).to(torch.bfloat16)
            up = torch.randn(shape, generator=generator).to(torch.bfloat16)
            out.append(Case({"gate": gate, "up": up}, silu_and_mul(gate, up), note))
        return out

    return run_cases("silu_and_mul_bf16", fn, cases, _bitwise, "llm_runtime.model.pointwise.silu_and_mul",
                     method=_arithmetic_in_float32)


# Operators that move or convert values without arithmetic: allowed on bfloat16 tensors. Any other operator given a
# bfloat16 tensor computes in bfloat16, which is the eager expression the exercise replaces.
_NO_ARITHMETIC = frozenset({"_to_copy", "to", "clone", "copy_", "detach", "alias", "view", "reshape", "_unsafe_view",
                            "expand", "contiguous", "empty_like", "lift_fresh", "t", "transpose", "permute"})


def _bfloat16_arithmetic(fn: Any, gate: torch.Tensor, up: torch.Tensor) -> list[str]:
    """The ATen operators `fn(gate, up)` runs with a bfloat16 input that are arithmetic (not a copy or a cast)."""
    _, calls = record_operators(fn, gate, up)
    return list(dict.fromkeys(call.name for call in calls
                              if torch.bfloat16 in call.input_dtypes and call.name not in _NO_ARITHMETIC))


def _arithmetic_in_float32(fn: Any) -> Verdict | None:
    generator = torch.Generator().manual_seed(19)
    gate = torch.randn(2, 64, generator=generator).to(torch.bfloat16)
    up = torch.randn(2, 64, generator=generator).to(torch.bfloat16)
    found = _bfloat16_arithmetic(fn, gate.clone(), up.clone())
    if not found:
        return None
    case = Case({"gate": gate, "up": up}, None, "any input: the way it is computed is the point")
    return method_verdict("silu_and_mul_bf16", case, "Every case agrees, but by arithmetic on bfloat16 tensors: that is "
                          "the eager expression itself. Convert to float32, compute there, and round to bfloat16 with "
                          "`.to(...)` exactly where the eager path holds a bfloat16 tensor, as the native step's C "
                          "code does.", "arithmetic on float32 tensors only (bfloat16 in and out, by casts)",
                          f"bfloat16 arithmetic: {', '.join(found)}")


def check_half_block_rows(fn: object) -> Verdict:
    """`half_block_rows(item) -> list[int]`: the 32 output rows, in order, of work item `item` of an int4 product:
    half h = item % 2 of block b = item // 2 of 64 rows, the 16 rows whose packed nibbles are the low ones of bytes
    16 h .. 16 h + 15 of each column (rows 64 b + 16 h + j), then the 16 in the high nibbles of the same bytes."""

    def cases() -> list[Case]:
        items = [0, 1, 2, 3, 29, 47] + random.Random(19).sample(range(4, 2000), 6)
        return [Case({"item": i}, reference_half_block_rows(i), "the first block's two halves" if i < 2 else "")
                for i in items]

    return run_cases("half_block_rows", fn, cases, same_value, "llm_runtime.lessons.decode_limit.half_block_rows")


def _same_runs(expected: list[range], got: Any) -> str | None:
    try:
        runs = [list(run) for run in got]
    except TypeError:
        return f"expected a list of {len(expected)} runs of item numbers, got {type(got).__name__}"
    return same_value([list(run) for run in expected], runs)


def check_static_schedule(fn: object) -> Verdict:
    """`static_schedule(num_items, num_threads) -> list`: for each thread, the items it runs (a list or a range)
    under `#pragma omp for schedule(static)` with libgomp: contiguous runs in thread order, as equal as can be, the
    first num_items % num_threads threads one more."""

    def cases() -> list[Case]:
        shapes = [(30, 2, "the bundled model's q/k/v: 30 half blocks"), (9, 2, "attention, 9 heads at batch 1"),
                  (5, 4, "more threads than a fair share"), (0, 2, "no items"), (3, 8, "fewer items than threads"),
                  (48, 3, "")]
        rng = random.Random(19)
        shapes += [(rng.randrange(0, 200), rng.randrange(1, 17), "") for _ in range(6)]
        return [Case({"num_items": n, "num_threads": t}, reference_static_schedule(n, t), note) for n, t, note in shapes]

    return run_cases("static_schedule", fn, cases, _same_runs, "llm_runtime.lessons.decode_limit.static_schedule")
