"""The lessons' token-equality rule: compare different computations on a float32 model."""

from __future__ import annotations

import copy

import pytest
import torch

from llm_runtime.lessons import assert_same_tokens, comparable_model


def test_a_float_model_is_its_own_comparable_model_and_a_bfloat16_one_gets_a_float32_copy(tiny_pairs) -> None:
    model, _ = tiny_pairs["llama2"]
    assert comparable_model(model) is model
    half = copy.deepcopy(model).to(torch.bfloat16)
    exact = comparable_model(half)
    assert exact is not half and exact.dtype == torch.float32 and half.dtype == torch.bfloat16
    assert exact.device == half.device
    ids = torch.tensor([[3, 5, 7, 9]])
    assert torch.allclose(exact.compute_logits(exact(ids)), half.compute_logits(half(ids)).float(), atol=0.1)


def test_assert_same_tokens_names_the_first_difference() -> None:
    assert_same_tokens([1, 2, 3], [1, 2, 3])
    with pytest.raises(AssertionError, match="differ at position 2 of 4 / 3"):
        assert_same_tokens([1, 2, 3, 4], [1, 2, 5])
    with pytest.raises(AssertionError, match="differ at position 3"):
        assert_same_tokens([1, 2, 3, 4], [1, 2, 3])
