"""The proposers on `Sequence` objects: prompt lookup per sequence, and the draft model's guesses, its paged KV
pool brought back to the sequence's tokens after a rejection, guesses that do not depend on what else is
proposed for (greedy or seeded), no guesses where the pool has no room, and the blocks it gives back."""

from __future__ import annotations

import copy

import torch

from llm_runtime import SamplingParams, generate
from llm_runtime.core.sequence import Sequence
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
    DraftModelProposer(model, num_speculative_tokens=4, num_blocks=8).propose([seq])
    assert seq.draft_token_ids == expected[2:6] and seq.draft_probs is None


def test_after_a_rejection_the_draft_cache_is_rewound_to_the_shared_prefix(tiny_pairs) -> None:
    """The target kept two of four guesses and sampled another token: the next guesses equal those of a
    proposer that never saw the rejected ones (its cache recomputed from scratch)."""
    model, _ = tiny_pairs["llama2"]
    seq = _sequence([3, 14, 15, 92, 65], output=[7])
    proposer = DraftModelProposer(model, num_speculative_tokens=4, num_blocks=8, block_size=4)
    proposer.propose([seq])
    first = seq.draft_token_ids
    replaced = (first[2] + 1) % model.config.vocab_size
    seq.output_token_ids += [*first[:2], replaced]  # two kept, the third replaced by the target's token
    proposer.propose([seq])
    again = _sequence(seq.prompt_token_ids, seq.output_token_ids, name="again")
    DraftModelProposer(model, num_speculative_tokens=4, num_blocks=8, block_size=4).propose([again])
    assert seq.draft_token_ids == again.draft_token_ids
    tokens = proposer.cached[seq]
    assert tokens == seq.prompt_token_ids + seq.output_token_ids + seq.draft_token_ids[:-1]
    assert len(proposer.block_manager.block_tables[seq]) == -(-len(tokens) // 4)


def test_sampled_requests_get_the_distributions_their_guesses_were_drawn_from(tiny_pairs) -> None:
    model, _ = tiny_pairs["llama2"]
    params = SamplingParams(temperature=0.8, top_k=5, max_tokens=16)
    seq = _sequence([3, 14, 15], output=[9], params=params)
    DraftModelProposer(model, num_speculative_tokens=3, num_blocks=8, seed=1).propose([seq])
    probs = seq.draft_probs
    assert probs.shape == (3, model.config.vocab_size)
    torch.testing.assert_close(probs.sum(-1), torch.ones(3, dtype=probs.dtype))
    assert ((probs > 0).sum(-1) <= 5).all()  # top-k applied to the draft's distribution
    assert all(probs[i, token] > 0 for i, token in enumerate(seq.draft_token_ids))


def test_blocks_of_sequences_no_longer_running_go_back(tiny_pairs) -> None:
    model, _ = tiny_pairs["llama2"]
    a, b = _sequence([1, 2, 3], [4], name="a"), _sequence([5, 6], [7], name="b")
    proposer = DraftModelProposer(copy.deepcopy(model), num_speculative_tokens=2, num_blocks=4, block_size=4)
    proposer.propose([a, b])
    assert set(proposer.cached) == {a, b} and proposer.block_manager.num_free_blocks == 1  # a: 5 slots, b: 4
    proposer.keep_only([b])
    assert set(proposer.cached) == {b} and set(proposer.block_manager.block_tables) == {b}
    assert proposer.block_manager.num_free_blocks == 3


def test_guesses_do_not_depend_on_what_else_is_proposed_for(tiny_pairs) -> None:
    """All decoding sequences go through the draft in one batch: each gets the guesses it gets alone, greedy or
    seeded (a seeded request's noise is its own seed's, not a generator the batch shares)."""
    model, _ = tiny_pairs["llama2"]
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=16)
    unseeded = SamplingParams(temperature=1.0, max_tokens=16)

    def batch() -> list[Sequence]:
        return [_sequence([3, 14, 15, 92], [65], name="greedy"), _sequence([8, 9], [10, 11, 12], seeded, "seeded"),
                _sequence([20, 21, 22], [], unseeded, "other"), _sequence([30] * 9, [31], seeded, "long")]

    together = batch()
    DraftModelProposer(model, num_speculative_tokens=3, num_blocks=32, block_size=4, seed=1).propose(together)
    for i in range(4):
        alone = batch()[i]
        DraftModelProposer(model, num_speculative_tokens=3, num_blocks=32, block_size=4, seed=2).propose([alone])
        if alone.params.seed is not None or alone.params.is_greedy:
            assert alone.draft_token_ids == together[i].draft_token_ids, alone
        assert len(alone.draft_token_ids) == 3
    other_seed = _sequence([8, 9], [10, 11, 12], SamplingParams(temperature=1.0, seed=8, max_tokens=16))
    DraftModelProposer(model, num_speculative_tokens=3, num_blocks=32, block_size=4).propose([other_seed])
    assert other_seed.draft_token_ids != together[1].draft_token_ids


def test_no_room_in_the_pool_means_no_guesses_not_an_error(tiny_pairs) -> None:
    """Two blocks of 4 tokens: a 9-token sequence cannot be held at all (it gets none, and holds nothing), a short one
    gets as many guesses as fit (its 3 tokens and 4 guesses but the last need 6 slots); max_tokens bounds them too."""
    model, _ = tiny_pairs["llama2"]
    long, short = _sequence(list(range(3, 12)), name="long"), _sequence([3, 4, 5], name="short")
    near_end = _sequence([3, 4], [5] * 30, name="end")  # 2 of its 32 tokens left: one guess
    proposer = DraftModelProposer(model, num_speculative_tokens=4, num_blocks=2, block_size=4)
    proposer.propose([long, short])
    assert long.draft_token_ids == [] and not proposer.block_manager.has_blocks(long)
    assert len(short.draft_token_ids) == 4
    DraftModelProposer(model, num_speculative_tokens=4, num_blocks=16, block_size=4).propose([near_end])
    assert len(near_end.draft_token_ids) == 1


def test_a_long_catch_up_runs_in_passes_of_bounded_size(tiny_pairs) -> None:
    """Sequences new to the draft bring their whole prompts: the first passes hold at most max_tokens_per_pass
    tokens (the activations the engine's budget counts), and the guesses are those of one unbounded pass."""
    model, _ = tiny_pairs["llama2"]

    def batch() -> list[Sequence]:
        return [_sequence(list(range(3, 40)), [41], name="long"), _sequence([5, 6, 7], [8], name="short"),
                _sequence(list(range(50, 62)), name="middle")]

    unbounded = batch()
    DraftModelProposer(model, num_speculative_tokens=3, num_blocks=64, block_size=4).propose(unbounded)
    bounded = batch()
    proposer = DraftModelProposer(model, num_speculative_tokens=3, num_blocks=64, block_size=4, max_tokens_per_pass=8)
    sizes, forward = [], proposer._forward
    proposer._forward = lambda seqs, starts, chunks, rows=None: sizes.append(sum(map(len, chunks))) or forward(
        seqs, starts, chunks, rows)
    proposer.propose(bounded)
    assert [seq.draft_token_ids for seq in bounded] == [seq.draft_token_ids for seq in unbounded]
    assert max(sizes) == 8 and sum(sizes) == 38 + 4 + 12 + 2 * 3  # every missing token once, then 2 guesses each
