"""Single-request generation: the cache changes nothing, and max_tokens, EOS, ignore_eos and min_tokens hold."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from llm_runtime import SamplingParams, generate


def greedy_without_cache(model, prompt: list[int], num_tokens: int) -> list[int]:
    """The naive loop: every step re-runs the whole sequence through the model."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(num_tokens):
            logits = model.compute_logits(model(torch.tensor([tokens]))[:, -1])
            tokens.append(int(logits.argmax(-1)))
    return tokens[len(prompt):]


@pytest.mark.parametrize("family", ["llama2", "qwen3", "smollm2"])
def test_decoding_with_cache_equals_without(tiny_pairs, family: str) -> None:
    model, _ = tiny_pairs[family]
    prompt = [3, 14, 15, 92, 65]
    cached = generate(model, prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert cached == greedy_without_cache(model, prompt, 40)


@pytest.mark.slow
def test_bundled_decoding_with_cache_equals_without(bundled) -> None:
    model, tokenizer = bundled
    prompt = tokenizer.encode("A list of fruits: apple, banana,")
    cached = generate(model, prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert cached == greedy_without_cache(model, prompt, 24)


def test_max_tokens_eos_ignore_eos_and_min_tokens(tiny_pairs, monkeypatch: pytest.MonkeyPatch) -> None:
    model, _ = tiny_pairs["llama2"]
    prompt = [7, 8, 9]
    free = generate(model, prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert len(free) == 12
    first = free.index(free[3])
    # stop_token_ids end the request right after the token, which is returned.
    stop_at = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[free[3]])
    assert generate(model, prompt, stop_at) == free[: first + 1]
    # Make that token the model's EOS: the same stop, unless ignore_eos.
    monkeypatch.setattr(model, "config", dataclasses.replace(model.config, eos_token_ids=(free[3],)))
    assert generate(model, prompt, SamplingParams(temperature=0, max_tokens=12)) == free[: first + 1]
    assert generate(model, prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)) == free
    # min_tokens masks the EOS until enough tokens exist.
    held = generate(model, prompt, SamplingParams(temperature=0, max_tokens=12, min_tokens=first + 2))
    assert len(held) >= first + 2 and free[3] not in held[: first + 2]


def test_invalid_prompts_are_rejected(tiny_pairs) -> None:
    model, _ = tiny_pairs["llama2"]
    params = SamplingParams(max_tokens=4)
    with pytest.raises(ValueError, match="empty"):
        generate(model, [], params)
    with pytest.raises(ValueError, match="integers"):
        generate(model, [1, model.config.vocab_size], params)
    with pytest.raises(ValueError, match="list of token ids"):
        generate(model, "hello", params)
    with pytest.raises(ValueError, match="context"):
        generate(model, [1] * model.config.max_position_embeddings, params)
    with pytest.raises(ValueError, match="max_tokens"):
        generate(model, [1] * 10, SamplingParams(max_tokens=model.config.max_position_embeddings))


def test_seeded_sampling_is_reproducible(tiny_pairs) -> None:
    model, _ = tiny_pairs["qwen2"]
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=11, max_tokens=20, ignore_eos=True)
    assert generate(model, [1, 2, 3], params) == generate(model, [1, 2, 3], params)
