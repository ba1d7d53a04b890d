"""The rejection sampler keeps the target's distribution exactly: on small vocabularies, the tokens it emits
at each position follow the target's p (a chi-square test on 60,000 draws, with draft distributions q far
from p, one-hot drafts as an n-gram proposer makes, and a p with filtered-out tokens), greedy reduces to
prefix matching, rows with fewer drafts take their bonus from the right position, and bad shapes are refused."""

from __future__ import annotations

import pytest
import torch

from llm_runtime.sampling import SamplingParams, sampling_probs
from llm_runtime.sampling.rejection import one_hot_greedy, rejection_sample

N = 60_000
CHI2_LIMIT = 25.0  # chi-square with at most 5 degrees of freedom: P(> 25) < 2e-4


def chi_square(tokens: torch.Tensor, p: torch.Tensor) -> float:
    """Pearson's statistic of `tokens` (M,) against p (V,); tokens where p is 0 must not occur."""
    counts = torch.bincount(tokens, minlength=len(p)).double()
    assert counts[p == 0].sum() == 0, "a token the target gives probability 0 came out"
    expected = p.double() * len(tokens)
    support = p > 0
    return float(((counts[support] - expected[support]) ** 2 / expected[support]).sum())


def draw(p: torch.Tensor, q: torch.Tensor | None, drafts_fixed: torch.Tensor | None, seed: int):
    """N independent rows of one speculative step with target p (k + 1, V) and draft q (k, V) (or fixed
    one-hot drafts (k,)): drafts drawn from q, then the rejection sampler."""
    gen = torch.Generator().manual_seed(seed)
    k, vocab = p.shape[0] - 1, p.shape[1]
    if q is not None:
        drafts = torch.multinomial(q, N, replacement=True, generator=gen).t().contiguous()  # (N, k)
        draft_probs = q.expand(N, k, vocab)
    else:
        drafts, draft_probs = drafts_fixed.expand(N, k).contiguous(), None
    uniform = torch.rand(N, k, generator=gen)
    noise = torch.empty(N, k + 1, vocab).exponential_(generator=gen)
    return rejection_sample(p.expand(N, k + 1, vocab), drafts, draft_probs, uniform, noise)


def targets(seed: int, k: int, vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    p = torch.rand(k + 1, vocab, generator=gen) ** 3
    p[1, 0] = 0.0  # a token filtered out at one position (top-k / top-p)
    return p / p.sum(-1, keepdim=True)


@pytest.mark.parametrize("proposer", ["draft model", "one-hot drafts"])
def test_every_emitted_position_follows_the_target(proposer: str) -> None:
    k, vocab = 3, 6
    p = targets(0, k, vocab)
    if proposer == "draft model":  # far from p: a draft that is often wrong
        q = torch.softmax(torch.randn(k, vocab, generator=torch.Generator().manual_seed(1)) * 2, -1)
        out = draw(p, q, None, seed=2)
    else:
        out = draw(p, None, p[:k].argmax(-1), seed=3)  # sure guesses, as prompt lookup makes: the likeliest tokens
    tokens, accepted = out.token_ids, out.num_accepted
    assert bool((accepted >= 0).all() and (accepted <= k).all())
    assert 0 < float((accepted == k).float().mean()) < 1
    for position in range(k + 1):
        emitted = accepted >= position  # rows that emit a token at this position this step
        assert int(emitted.sum()) > 1000, position
        statistic = chi_square(tokens[emitted, position], p[position])
        assert statistic < CHI2_LIMIT, (position, statistic)
    # Nothing after a row's last token.
    column = torch.arange(k + 1)[None]
    assert bool((tokens[column > accepted[:, None]] == -1).all())
    assert bool((tokens[column <= accepted[:, None]] >= 0).all())


def test_acceptance_is_the_overlap_of_p_and_q() -> None:
    """P(keep the first draft) = sum_x min(p(x), q(x)): the rate lesson 14 plots."""
    k, vocab = 1, 6
    p = targets(4, k, vocab)
    q = torch.softmax(torch.randn(k, vocab, generator=torch.Generator().manual_seed(5)), -1)
    out = draw(p, q, None, seed=6)
    expected = float(torch.minimum(p[0], q[0]).sum())
    measured = float((out.num_accepted >= 1).double().mean())
    assert abs(measured - expected) < 4 * (expected * (1 - expected) / N) ** 0.5


def test_greedy_is_prefix_matching_then_the_argmax() -> None:
    logits = torch.tensor([[[0.0, 5.0, 1.0], [2.0, 2.0, 0.0], [0.0, 0.0, 9.0], [1.0, 0.0, 0.0]]])  # (1, k + 1 = 4, 3)
    p = one_hot_greedy(logits)
    assert p[0, 1].tolist() == [1.0, 0.0, 0.0]  # the first of equal maxima
    noise = torch.ones(1, 4, 3)
    cases = {(1, 0, 2): ([1, 0, 2, 0], 3), (1, 0, 1): ([1, 0, 2, -1], 2), (2, 0, 2): ([1, -1, -1, -1], 0)}
    for drafts, (expected, accepted) in cases.items():
        for uniform in (torch.full((1, 3), 0.999), torch.full((1, 3), 1e-6)):  # greedy: u never matters
            out = rejection_sample(p, torch.tensor([drafts]), None, uniform, noise)
            assert out.token_ids[0].tolist() == expected and int(out.num_accepted[0]) == accepted


def test_rows_with_fewer_drafts_take_their_bonus_after_their_last() -> None:
    logits = torch.tensor([[[9.0, 0.0], [0.0, 9.0], [9.0, 0.0]]]).expand(2, 3, 2)
    p = one_hot_greedy(logits)
    drafts = torch.tensor([[0, 1], [0, 0]])  # row 1 drafted one token; its second is padding
    out = rejection_sample(p, drafts, None, torch.full((2, 2), 0.5), torch.ones(2, 3, 2),
                           num_drafts=torch.tensor([2, 1]))
    assert out.token_ids.tolist() == [[0, 1, 0], [0, 1, -1]] and out.num_accepted.tolist() == [2, 1]


def test_bad_shapes_are_refused() -> None:
    p = torch.full((2, 3, 4), 0.25)
    with pytest.raises(ValueError, match="draft_token_ids and uniform must be"):
        rejection_sample(p, torch.zeros(2, 3, dtype=torch.long), None, torch.rand(2, 2), torch.ones(2, 3, 4))
    with pytest.raises(ValueError, match="draft_probs must be"):
        rejection_sample(p, torch.zeros(2, 2, dtype=torch.long), torch.rand(2, 2, 5), torch.rand(2, 2),
                         torch.ones(2, 3, 4))


@pytest.mark.parametrize("top_p", [1.0, 0.7])
def test_against_the_samplers_own_distributions(top_p: float) -> None:
    """Temperature 1 with and without top-p: the target is what `Sampler` would draw from."""
    k, vocab = 2, 6
    gen = torch.Generator().manual_seed(7)
    p = sampling_probs(torch.randn(k + 1, vocab, generator=gen) * 2, [SamplingParams(temperature=1.0, top_p=top_p)] * (k + 1))
    assert (top_p < 1) == bool((p == 0).any())  # top-p removed some tokens
    q = torch.softmax(torch.randn(k, vocab, generator=gen), -1)
    out = draw(p, q, None, seed=8)
    for position in range(k + 1):
        emitted = out.num_accepted >= position
        assert chi_square(out.token_ids[emitted, position], p[position]) < CHI2_LIMIT, position
