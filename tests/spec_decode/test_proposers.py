"""The proposers on `Sequence` objects: prompt lookup per sequence, and the draft model's guesses, its own KV
cache brought back to the sequence's tokens after a rejection, and the caches it drops."""

from __future__ import annotations

import copy

import torch

from llm_runtime import SamplingParams, generate
from llm_runtime.engine.sequence import Sequence
from llm_runtime.spec_decode import DraftModelProposer, NgramProposer

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def _sequence(prompt: list[int], output: list[int] = (), params: SamplingParams = GREEDY, name: str = "r") -> Sequence:
    seq = Sequence(name, list(prompt), params, max_new_tokens=params.max_tokens)
    seq.output_token_ids = list(output)
    return seq


def test_ngram_proposer_looks_up_each_sequence_in_its_own_tokens() -> None:
    repeats = _sequence([5, 6, 7, 8, 5, 6], output=[7])  # ... 5 6 7 seen before: 8 5 6 7 follow
    fresh = _sequence([1, 2, 3], output=[4])
    proposer = NgramProposer(num_speculative_tokens=3, prompt_lookup_max=3)
    proposer.propose([repeats, fresh])
    assert repeats.draft_token_ids == [8, 5, 6] and repeats.draft_probs is None
    assert fresh.draft_token_ids == []


def test_draft_model_guesses_are_its_own_greedy_continuation(tiny_pairs) -> None:
    model, _ = tiny_pairs["llama2"]
    prompt = [3, 14, 15, 92, 65]
    expected = generate(model, prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    seq = _sequence(prompt, output=expected[:2])
    DraftModelProposer(model, num_speculative_tokens=4).propose([seq])
    assert seq.draft_token_ids == expected[2:6] and seq.draft_probs is None


def test_after_a_rejection_the_draft_cache_is_rewound_to_the_shared_prefix(tiny_pairs) -> None:
    """The target kept two of four guesses and sampled another token: the next guesses equal those of a
    proposer that never saw the rejected ones (its cache recomputed from scratch)."""
    model, _ = tiny_pairs["llama2"]
    seq = _sequence([3, 14, 15, 92, 65], output=[7])
    proposer = DraftModelProposer(model, num_speculative_tokens=4)
    proposer.propose([seq])
    first = seq.draft_token_ids
    replaced = (first[2] + 1) % model.config.vocab_size
    seq.output_token_ids += [*first[:2], replaced]  # two kept, the third replaced by the target's token
    proposer.propose([seq])
    again = _sequence(seq.prompt_token_ids, seq.output_token_ids, name="again")
    DraftModelProposer(model, num_speculative_tokens=4).propose([again])
    assert seq.draft_token_ids == again.draft_token_ids
    cache, tokens = proposer.caches[seq]
    assert tokens == seq.prompt_token_ids + seq.output_token_ids + seq.draft_token_ids[:-1]
    assert cache.num_tokens == len(tokens)


def test_sampled_requests_get_the_distributions_their_guesses_were_drawn_from(tiny_pairs) -> None:
    model, _ = tiny_pairs["llama2"]
    params = SamplingParams(temperature=0.8, top_k=5, max_tokens=16)
    seq = _sequence([3, 14, 15], output=[9], params=params)
    DraftModelProposer(model, num_speculative_tokens=3, seed=1).propose([seq])
    probs = seq.draft_probs
    assert probs.shape == (3, model.config.vocab_size)
    torch.testing.assert_close(probs.sum(-1), torch.ones(3, dtype=probs.dtype))
    assert ((probs > 0).sum(-1) <= 5).all()  # top-k applied to the draft's distribution
    assert all(probs[i, token] > 0 for i, token in enumerate(seq.draft_token_ids))


def test_caches_of_sequences_no_longer_running_are_dropped(tiny_pairs) -> None:
    model, _ = tiny_pairs["llama2"]
    a, b = _sequence([1, 2, 3], [4], name="a"), _sequence([5, 6], [7], name="b")
    proposer = DraftModelProposer(copy.deepcopy(model), num_speculative_tokens=2)
    proposer.propose([a, b])
    assert set(proposer.caches) == {a, b}
    proposer.keep_only([b])
    assert set(proposer.caches) == {b}
