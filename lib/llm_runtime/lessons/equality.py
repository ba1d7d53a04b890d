"""Where token-equality asserts hold, written once for every lesson.

Two computations give the same greedy tokens only if their logits never reorder the top two.
In float32 (24 bits of mantissa) a different batch shape, chunk size or kernel changes the last
bits of a logit (lesson 02 measures it: hundred-thousandths on logits of size ~10), and the argmax
survives unless two logits tie that closely: across the lessons' prompts that does not happen. In
bfloat16 (8 bits of mantissa; float16 has 11) the same change, where it moves a logit at all, moves
it by tenths (lesson 02 prints how far), enough to flip near-ties over a long generation. So the rule is:

- compare tokens of two *different* computations (batched against alone, paged against contiguous,
  cached against recomputed, ours against transformers) on a float32 model: `comparable_model`
  returns the model itself when it is float32 or float64, else a float32 copy;
- in the reader's dtype, assert only what is equal by construction (the same computation twice).

`assert_same_tokens` does the comparison and, when it fails, says where the two first differ.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch

from ..model import CausalLM
from ..model.tokenizer import Tokenizer

EXACT_DTYPES = (torch.float32, torch.float64)


def comparable_model(model: CausalLM) -> CausalLM:
    """`model` if its dtype keeps argmaxes stable across batch shapes (float32/64), else a float32 copy
    on the same device (for the bundled model: 0.5 GB more on the device while it lives)."""
    if model.dtype in EXACT_DTYPES:
        return model
    return copy.deepcopy(model).to(torch.float32)


def assert_same_tokens(expected: Sequence[int], actual: Sequence[int], tokenizer: Tokenizer | None = None,
                       what: str = "tokens") -> None:
    """Assert two token sequences are equal; the error names the first position where they differ."""
    expected, actual = list(expected), list(actual)
    if expected == actual:
        return
    first = next((i for i, (a, b) in enumerate(zip(expected, actual)) if a != b), min(len(expected), len(actual)))

    def show(tokens: list[int]) -> str:
        return repr(tokenizer.decode(tokens)) if tokenizer is not None else str(tokens)

    raise AssertionError(
        f"{what} differ at position {first} of {len(expected)} / {len(actual)}: "
        f"expected ...{show(expected[max(0, first - 4):first + 4])}, got ...{show(actual[max(0, first - 4):first + 4])}"
    )
