"""Lesson 12 exercises: a step's inputs without a loop per token, and three projections as one multiply.

- `slot_mappings(block_tables, starts, num_new_tokens, block_size)`: the flat pool slot of every new
  token of a ragged batch, against `AttentionMetadata.build` (and the engine's `InputBuffers`).
- `fused_qkv(x, q_weight, k_weight, v_weight)`: q, k and v of `x` from one matrix multiply, against three
  `F.linear` calls (what packing's `FusedPackedLinear` does).
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from ...attention.metadata import AttentionMetadata
from .check import Case, Compare, Verdict, close_tensors, method_verdict, run_cases, same_value
from .operators import MATMULS, python_lines, record_operators


def check_slot_mappings(fn: object) -> Verdict:
    """`slot_mappings(block_tables, starts, num_new_tokens, block_size) -> list[int]`: a step's sequences,
    each with its block table (a list of block ids), the position of its first new token and how many
    new tokens it has. Token at position p of sequence b goes to block block_tables[b][p // block_size],
    offset p % block_size: flat slot block * block_size + offset. Return the slots of every new token,
    sequence after sequence, as a list of ints (tensors of the whole batch at once, no loop per token)."""

    def cases() -> list[Case]:
        rng = random.Random(12)
        inputs = [([[7, 2], [5], [0, 3, 6]], [5, 0, 9], [3, 4, 1], 4, "the lesson's step"),
                  ([[3]], [0], [1], 1, "blocks of one token")]
        for _ in range(40):
            block_size = rng.choice([1, 2, 4, 16])
            starts, counts, tables = [], [], []
            for _ in range(rng.randint(1, 6)):
                start, count = rng.randrange(40), rng.randint(1, 20)
                starts.append(start)
                counts.append(count)
                tables.append(rng.sample(range(200), -(-(start + count) // block_size) + rng.randint(0, 2)))
            inputs.append((tables, starts, counts, block_size, ""))
        return [Case({"block_tables": t, "starts": s, "num_new_tokens": n, "block_size": b},
                     AttentionMetadata.build(t, s, n, block_size=b, device="cpu").slot_mapping.tolist(), note)
                for t, s, n, b, note in inputs]

    return run_cases("slot_mappings", fn, cases, _as_list(same_value), "llm_runtime.attention.AttentionMetadata.build",
                     method=_no_loop_per_token)


def _no_loop_per_token(fn: object) -> Verdict | None:
    """Fails an answer whose tensor operations grow with the number of tokens (a loop per token), that uses
    none, or whose own Python lines grow with the tokens (a loop over the tokens, whatever tensor it ends in);
    None when one batch of tensor operations serves any count."""
    tables, starts, block_size = [[7, 2, 9, 11, 12, 13, 14, 15, 16], [5, 6, 3, 8, 4, 10, 1, 0, 17]], [5, 0], 4
    counts, lines = {}, {}

    def arguments(tokens: int) -> list:
        return [[list(t) for t in tables], list(starts), [tokens, tokens], block_size]

    for tokens in (3, 24):
        _, calls = record_operators(fn, *arguments(tokens))
        counts[tokens] = len(calls)
        lines[tokens] = python_lines(fn, *arguments(tokens))
    case = Case({"block_tables": tables, "starts": starts, "num_new_tokens": [24, 24], "block_size": block_size},
                None, "two sequences, 3 and then 24 new tokens each")
    expected = "the same tensor operations for 3 new tokens a sequence as for 24 (whole tensors, no loop per token)"
    if counts[3] == 0:
        return method_verdict("slot_mappings", case, "It gives the right answer without any tensor operation: a "
                              "loop over the tokens in Python.", expected, "no tensor operation at all")
    if counts[24] != counts[3]:
        return method_verdict("slot_mappings", case, "It gives the right answer, but with a loop per token: the "
                              "more tokens, the more tensor operations.", expected,
                              f"{counts[3]} operations for 3 tokens a sequence, {counts[24]} for 24")
    if lines[24] > lines[3]:
        return method_verdict("slot_mappings", case, "It gives the right answer, but with a loop over the tokens "
                              "in Python (the more tokens, the more lines Python runs), whatever tensor it ends in.",
                              expected, f"{lines[3]} lines of your code run for 3 tokens a sequence, {lines[24]} "
                              "for 24")
    return None


def _as_list(compare: Compare) -> Compare:
    """Accept a tensor where a list is expected."""
    return lambda expected, got: compare(expected, got.tolist() if isinstance(got, torch.Tensor) else got)


def check_fused_qkv(fn: object) -> Verdict:
    """`fused_qkv(x, q_weight, k_weight, v_weight) -> (q, k, v)`: x (tokens, hidden); each weight
    (out_features, hidden), q's wider than k's and v's as in grouped-query attention. Return x @ W^T for
    each weight, as three tensors, computed by a single matrix multiply (concatenate the weights once;
    split the product)."""

    def cases() -> list[Case]:
        generator = torch.Generator().manual_seed(12)
        out = []
        for tokens, hidden, q_out, kv_out in [(1, 8, 8, 4), (5, 16, 16, 4), (3, 12, 12, 12), (17, 32, 64, 16)]:
            x = torch.randn(tokens, hidden, generator=generator, dtype=torch.float64)
            weights = [torch.randn(n, hidden, generator=generator, dtype=torch.float64) for n in (q_out, kv_out, kv_out)]
            out.append(Case({"x": x, "q_weight": weights[0], "k_weight": weights[1], "v_weight": weights[2]},
                            tuple(F.linear(x, w) for w in weights)))
        return out

    tensors = close_tensors(rtol=1e-9, atol=1e-9)

    def compare(expected: tuple[torch.Tensor, ...], got: object) -> str | None:
        if not isinstance(got, (tuple, list)) or len(got) != 3:
            return "expected three tensors (q, k, v)"
        for name, e, g in zip("qkv", expected, got):
            difference = tensors(e, g)
            if difference is not None:
                return f"{name}: {difference}"
        return None

    return run_cases("fused_qkv", fn, cases, compare, "three F.linear calls",
                     method=lambda candidate: _one_multiply(candidate, cases()[1]))


def _one_multiply(fn: object, case: Case) -> Verdict | None:
    """Fails an answer that makes more (or fewer) than one matrix multiply, or whose one multiply is not all three
    products at once (q's alone, with k and v done another way); None when one multiply makes all of q, k, v."""
    _, calls = record_operators(fn, *[t.clone() for t in case.args.values()])
    multiplies = [call for call in calls if call.name in MATMULS]
    x, q_weight, k_weight, v_weight = case.args.values()
    every_output = x.shape[0] * (q_weight.shape[0] + k_weight.shape[0] + v_weight.shape[0])
    expected = "one matrix multiply (concatenate the weights once, split the product)"
    if len(multiplies) != 1:
        return method_verdict("fused_qkv", case, f"It gives the right answer, but with {len(multiplies)} matrix "
                              "multiplies.", expected,
                              f"{len(multiplies)} (`mm`, `addmm` and the like, counted as PyTorch runs them)")
    made = multiplies[0].outputs[0][0] if multiplies[0].outputs else 0
    if made != every_output:
        return method_verdict("fused_qkv", case, "It gives the right answer, but its one matrix multiply makes only "
                              "part of q, k and v: the rest is computed another way.", expected,
                              f"a multiply of {made} outputs, where q, k and v together are {every_output}")
    return None
