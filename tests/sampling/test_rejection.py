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


# ------------------------------------------------------------------ the engine's RejectionSampler
from llm_runtime.sampling import Sampler  # noqa: E402
from llm_runtime.sampling.rejection import RejectionSampler  # noqa: E402
from llm_runtime.sampling.seeded import SeededGenerator  # noqa: E402


def _verify(logits_rows, drafts, params, generators=None, outputs=None, draft_probs=None, blocked=None):
    batch = len(drafts)
    return RejectionSampler(Sampler(seed=0))(
        logits_rows, drafts, draft_probs or [None] * batch, params, generators or [None] * batch,
        outputs or [[] for _ in range(batch)], [[] for _ in range(batch)], blocked or [() for _ in range(batch)])


def test_greedy_sequences_keep_the_drafts_that_are_the_argmaxes() -> None:
    logits = torch.full((3 + 1 + 2 + 1, 8), -1.0)  # k + 1 rows per sequence
    for row, best in enumerate([4, 5, 6, 7, 2, 3, 1]):
        logits[row, best] = 1.0
    greedy = SamplingParams(temperature=0)
    out = _verify(logits, [[4, 5, 1], [2, 0]], [greedy, greedy])
    assert out.accepted == [[4, 5], [2]]  # the third guess (1) is not the argmax (6): 6 comes out instead
    assert out.next_token_ids == [6, 3]
    out = _verify(logits[:4], [[4, 5, 6]], [greedy])
    assert out.accepted == [[4, 5, 6]] and out.next_token_ids == [7]  # all kept: the bonus


def test_each_position_is_the_distribution_with_the_drafts_before_it_counted() -> None:
    """With a frequency penalty, position 1's distribution counts draft 0 as output: sampled sequences keep
    draft 0 (certain: it is the only token position 0 allows) and draw position 1 from the penalized p."""
    vocab, n = 4, 40_000
    logits = torch.tensor([[0.0, -1e9, -1e9, -1e9], [0.0, 0.0, 0.0, 0.0]]).repeat(n, 1)  # (2n, V)
    params = [SamplingParams(temperature=1.0, frequency_penalty=1.5)] * n
    out = _verify(logits, [[0]] * n, params)
    assert all(a == [0] for a in out.accepted)
    penalized = torch.tensor([-1.5, 0.0, 0.0, 0.0]).softmax(-1)  # token 0 seen once as output
    assert chi_square(torch.tensor(out.next_token_ids), penalized) < CHI2_LIMIT


def test_min_tokens_blocks_eos_at_the_positions_before_it() -> None:
    """EOS (token 3) blocked while output + position < min_tokens: a greedy draft of EOS there is refused."""
    logits = torch.zeros(3, 5)
    logits[:, 3] = 5.0  # EOS is the argmax everywhere
    logits[:, 1] = 1.0
    params = [SamplingParams(temperature=0, min_tokens=3)]
    out = _verify(logits, [[1, 3]], params, outputs=[[9]], blocked=[(3,)])  # 1 output so far: positions 0, 1 blocked
    assert out.accepted == [[1]] and out.next_token_ids == [1]  # EOS refused at position 1 (output 2 < 3)


def test_seeded_sequences_draw_the_same_whatever_shares_the_batch() -> None:
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(4, 50, generator=gen)
    params = SamplingParams(temperature=1.0, seed=7)
    alone = _verify(logits, [[1, 2, 3]], [params], generators=[SeededGenerator(7)], outputs=[[5, 6]])
    noise_rows = torch.randn(3, 50, generator=gen)
    crowded = _verify(torch.cat([noise_rows, logits]), [[4, 4], [1, 2, 3]],
                      [SamplingParams(temperature=1.0), params], generators=[None, SeededGenerator(7)],
                      outputs=[[1], [5, 6]])
    assert crowded.accepted[1] == alone.accepted[0] and crowded.next_token_ids[1] == alone.next_token_ids[0]


def test_a_sampled_sequence_follows_the_target_with_a_draft_models_guesses() -> None:
    """Sequences whose k = 2 guesses come from a distribution q: the first emitted token follows the target's
    sampling distribution (temperature 0.7, top-k 4), through the engine-facing sampler."""
    vocab, n, k = 6, 40_000, 2
    gen = torch.Generator().manual_seed(6)
    target_logits = torch.randn(k + 1, vocab, generator=gen)
    q = torch.softmax(torch.randn(k, vocab, generator=gen), -1)
    drafts = torch.multinomial(q, n, replacement=True, generator=gen).t().tolist()  # (n, k)
    params = SamplingParams(temperature=0.7, top_k=4)
    out = _verify(target_logits.repeat(n, 1), drafts, [params] * n, draft_probs=[q] * n)
    first = torch.tensor([(a + [t])[0] for a, t in zip(out.accepted, out.next_token_ids)])
    p = sampling_probs(target_logits[:1], [params])[0]
    assert chi_square(first, p) < CHI2_LIMIT
