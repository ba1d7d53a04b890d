"""Our CausalLM against transformers' models: logits on tiny float64 models, greedy text on the bundled one."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY_FAMILIES, transformers_greedy
from llm_runtime import SamplingParams, generate


def _reference_logits(reference: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return reference(input_ids=input_ids).logits


@pytest.mark.parametrize("family", list(TINY_FAMILIES))
def test_logits_match_transformers_float64(tiny_pairs, family: str) -> None:
    ours, reference = tiny_pairs[family]
    torch.manual_seed(1)
    input_ids = torch.randint(0, ours.config.vocab_size, (2, 150))  # long enough to reach scaled rope bands
    with torch.no_grad():
        logits = ours.compute_logits(ours(input_ids))
    expected = _reference_logits(reference, input_ids)
    assert logits.dtype == torch.float64
    assert (logits - expected).abs().max().item() < 1e-8


@pytest.mark.parametrize("family", list(TINY_FAMILIES))
def test_cached_forward_equals_full_forward(tiny_pairs, family: str) -> None:
    """Prefill a prefix, then a chunk, then single tokens: every position's logits equal one full pass."""
    ours, _ = tiny_pairs[family]
    torch.manual_seed(2)
    input_ids = torch.randint(0, ours.config.vocab_size, (2, 40))
    with torch.no_grad():
        full = ours.compute_logits(ours(input_ids))
        cache = ours.new_kv_cache(batch_size=2, max_seq_len=40)
        pieces = [ours.compute_logits(ours(input_ids[:, :25], cache)),   # prefill
                  ours.compute_logits(ours(input_ids[:, 25:33], cache))]  # a chunk after cached tokens
        for t in range(33, 40):
            pieces.append(ours.compute_logits(ours(input_ids[:, t : t + 1], cache)))  # decode
    assert cache.num_tokens == 40
    assert (torch.cat(pieces, dim=1) - full).abs().max().item() < 1e-10


def test_tied_embeddings_share_storage(tiny_pairs) -> None:
    ours, _ = tiny_pairs["qwen2"]
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    untied, _ = tiny_pairs["qwen3"]
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight


def test_qwen_variants_have_their_features(tiny_pairs) -> None:
    qwen2, _ = tiny_pairs["qwen2"]
    assert qwen2.model.layers[0].self_attn.q_proj.bias is not None
    qwen3, _ = tiny_pairs["qwen3"]
    assert qwen3.model.layers[0].self_attn.q_norm is not None
    assert qwen3.config.head_dim == 32  # explicit head_dim, not hidden / heads


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_greedy_generate_matches_transformers_float64(tiny_pairs, family: str) -> None:
    ours, reference = tiny_pairs[family]
    prompt = [5, 17, 3, 42, 8, 11]
    ours_tokens = generate(ours, prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    assert ours_tokens == transformers_greedy(reference, prompt, 30)


@pytest.mark.slow
def test_bundled_logits_close_to_transformers(bundled, bundled_reference) -> None:
    model, tokenizer = bundled
    input_ids = torch.tensor([tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4)])
    with torch.no_grad():
        ours = model.compute_logits(model(input_ids))
    expected = _reference_logits(bundled_reference, input_ids)
    assert (ours - expected).abs().max().item() < 1e-3
    assert torch.equal(ours.argmax(-1), expected.argmax(-1))


BUNDLED_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "To make a cup of tea, first",
]


@pytest.mark.slow
def test_bundled_greedy_matches_transformers_generate(bundled, bundled_reference) -> None:
    """32 greedy tokens for each prompt, token for token, EOS ignored on both sides."""
    model, tokenizer = bundled
    for prompt in BUNDLED_PROMPTS:
        ids = tokenizer.encode(prompt)
        ours = generate(model, ids, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
        assert len(ours) == 32
        assert ours == transformers_greedy(bundled_reference, ids, 32), prompt
