"""Lesson 17 exercises: a product split by columns then rows, the KV heads a rank keeps, and a ring all-reduce.

- `parallel_product(x, a, b, size)`: every rank's partial product, against `lessons.tensor_parallel.parallel_product`.
- `kv_heads_for_rank(num_heads, num_kv_heads, size, rank)`: the KV heads a rank's query heads read, split or
  replicated, against `distributed.sharding.heads_of_rank` (through `lessons.tensor_parallel.kv_heads_for_rank`).
- `ring_all_reduce(parts)`: a ring all-reduce simulated step by step, with the values each rank sends, against
  `lessons.tensor_parallel.ring_all_reduce`.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from ..tensor_parallel import kv_heads_for_rank as reference_kv_heads_for_rank
from ..tensor_parallel import parallel_product as reference_parallel_product
from ..tensor_parallel import ring_all_reduce as reference_ring_all_reduce
from .check import Case, Verdict, close_tensors, run_cases, same_value


def _tensor_lists(expected: list[torch.Tensor], got: Any) -> str | None:
    """A list of tensors (one per rank), each close to the package's."""
    if not isinstance(got, (list, tuple)):
        return f"expected a list of {len(expected)} tensors (one per rank), got {type(got).__name__}"
    if len(got) != len(expected):
        return f"expected {len(expected)} tensors (one per rank), got {len(got)}"
    for rank, (e, g) in enumerate(zip(expected, got)):
        difference = close_tensors(rtol=1e-9, atol=1e-9)(e, g)
        if difference is not None:
            return f"rank {rank}: {difference}"
    return None


def check_parallel_product(fn: object) -> Verdict:
    """`parallel_product(x, a, b, size) -> list[Tensor]`: x (M, K), a (K, N), b (N, P), `size` dividing N. Cut
    a's N columns in `size` contiguous equal blocks, in order; rank r's partial is x @ a[:, block r] @
    b[block r, :] (M, P). Return the `size` partials, rank 0 first (float64 inputs; compared to rounding)."""

    def cases() -> list[Case]:
        generator = torch.Generator().manual_seed(17)
        out = []
        for m, k, n, p, size, note in [(2, 3, 4, 2, 2, "two ranks"), (3, 5, 6, 4, 3, "three ranks"),
                                       (1, 4, 8, 3, 4, "one row, four ranks"), (2, 2, 5, 2, 1, "one rank: the product"),
                                       (4, 6, 12, 5, 6, "six ranks"), (2, 3, 6, 6, 2, "")]:
            out.append(Case({"x": torch.randn(m, k, generator=generator, dtype=torch.float64),
                             "a": torch.randn(k, n, generator=generator, dtype=torch.float64),
                             "b": torch.randn(n, p, generator=generator, dtype=torch.float64), "size": size}, None, note))
        for case in out:
            case.expected = reference_parallel_product(**case.args)
        return out

    return run_cases("parallel_product", fn, cases, _tensor_lists,
                     "llm_runtime.lessons.tensor_parallel.parallel_product")


def check_kv_heads_for_rank(fn: object) -> Verdict:
    """`kv_heads_for_rank(num_heads, num_kv_heads, size, rank) -> list[int]`: the query heads are cut in `size`
    contiguous equal blocks, rank r holding block r; query head q reads KV head q // (num_heads // num_kv_heads).
    Return the sorted KV heads rank `rank`'s query heads read (shapes that split: size divides num_heads, and
    num_kv_heads divides over size or size is a multiple of num_kv_heads)."""

    def cases() -> list[Case]:
        shapes = [(9, 3, 3, "the bundled model at 3 ranks"), (8, 2, 4, "2 KV heads replicated over 4 ranks"),
                  (8, 1, 2, "a single KV head on both ranks"), (32, 8, 2, "4 KV heads per rank"),
                  (16, 16, 4, "multi-head attention: as many KV heads as query heads"), (8, 2, 8, ""),
                  (12, 4, 2, ""), (24, 3, 6, "3 KV heads over 6 ranks"), (4, 4, 1, "one rank: every head")]
        rng = random.Random(17)
        for _ in range(12):
            kv = rng.choice([1, 2, 4, 8])
            group = rng.choice([1, 2, 3, 4])
            size = rng.choice([s for s in (1, 2, 4, 8, 16) if (kv * group) % s == 0 and (kv % s == 0 or s % kv == 0)])
            shapes.append((kv * group, kv, size, ""))
        return [Case({"num_heads": h, "num_kv_heads": kv, "size": size, "rank": rank},
                     reference_kv_heads_for_rank(h, kv, size, rank), note)
                for h, kv, size, note in shapes for rank in range(size)]

    return run_cases("kv_heads_for_rank", fn, cases, same_value,
                     "llm_runtime.distributed.sharding.heads_of_rank")


def _ring_results(expected: tuple[list[torch.Tensor], list[int]], got: Any) -> str | None:
    if not isinstance(got, (list, tuple)) or len(got) != 2:
        return "expected a pair: (every rank's tensor, the values each rank sent)"
    difference = _tensor_lists(expected[0], got[0])
    if difference is not None:
        return f"the tensors: {difference}"
    if list(got[1]) != list(expected[1]):
        return f"the values sent per rank: expected {expected[1]}, got {list(got[1])}"
    return None


def check_ring_all_reduce(fn: object) -> Verdict:
    """`ring_all_reduce(parts) -> (list[Tensor], list[int])`: n ranks, rank r holding parts[r] (1-D, one length
    that n divides), each cut in n equal chunks. Reduce-scatter, steps s = 0 .. n-2, all ranks at once: rank r
    sends its chunk (r - s) mod n to rank (r + 1) mod n, which adds it to its own. All-gather, steps s = 0 ..
    n-2: rank r sends its chunk (r + 1 - s) mod n and the receiver replaces its own with it. Return each rank's
    final tensor (every one the sum, added in the ring's order: in floating point another order gives other
    values, and the checker has inputs where it does) and how many values each rank sent in all."""

    def cases() -> list[Case]:
        generator = torch.Generator().manual_seed(17)
        out = []
        for n, length, note in [(2, 4, "two ranks"), (3, 6, "three ranks"), (4, 8, "four ranks"),
                                (1, 5, "one rank: nothing to send"), (5, 10, ""), (8, 16, "eight ranks"),
                                (3, 3, "chunks of one value")]:
            parts = [torch.randint(-9, 10, (length,), generator=generator).double() for _ in range(n)]
            out.append(Case({"parts": parts}, reference_ring_all_reduce(parts), note))
        # Sums whose order shows: in float64 2**53 + 1 rounds back to 2**53, so a chunk's sum depends on where the
        # ring starts adding it (rank c for chunk c), and one sum of whole tensors gives other values.
        big = float(2**53)
        for values, note in [([big, 1.0, -big], "three ranks, sums whose order shows"),
                             ([big, 1.0, 1.0, -big], "four ranks, sums whose order shows")]:
            n = len(values)
            parts = [torch.full((2 * n,), v, dtype=torch.float64) for v in values]
            out.append(Case({"parts": parts}, reference_ring_all_reduce(parts), note))
        return out

    return run_cases("ring_all_reduce", fn, cases, _ring_results, "llm_runtime.lessons.tensor_parallel.ring_all_reduce")
