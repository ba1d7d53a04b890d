"""Quality against a reference: identical models agree everywhere, a perturbed one is measured as such."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from llm_runtime.bench.quality import compare, eval_text


def test_a_model_against_itself_and_against_a_perturbed_copy(tiny_pairs) -> None:
    model = copy.deepcopy(tiny_pairs["llama2"][0]).float()
    ids = torch.randint(3, model.config.vocab_size, (70,), generator=torch.Generator().manual_seed(0)).tolist()
    same = compare(model, model, ids, window=32)  # windows of 32, 32 and 5 positions
    assert same.num_positions == 69 and same.top1_agreement == 1.0
    assert same.kl_divergence == pytest.approx(0.0, abs=1e-6) and same.perplexity == same.reference_perplexity
    perturbed = copy.deepcopy(model)
    with torch.no_grad():
        perturbed.lm_head.weight.add_(0.2 * torch.randn_like(perturbed.lm_head.weight))
    moved = compare(perturbed, model, ids, window=32)
    assert moved.kl_divergence > 0.01 and moved.top1_agreement < 1.0
    assert moved.reference_perplexity == pytest.approx(same.perplexity)
    # Perplexity is exp(mean NLL): a uniform model over V tokens has perplexity V.
    uniform = copy.deepcopy(model)
    with torch.no_grad():
        uniform.lm_head.weight.zero_()
    assert compare(uniform, model, ids).perplexity == pytest.approx(model.config.vocab_size)
    with pytest.raises(ValueError):
        compare(model, model, [5])
    assert math.isfinite(moved.perplexity)


def test_the_evaluation_text_ships_with_the_package() -> None:
    text = eval_text()
    assert len(text.split()) > 1000 and text.startswith("The Keepers of the Light")
