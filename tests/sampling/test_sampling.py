"""SamplingParams validation, and the Sampler checked statistically against the distribution each filter defines."""

from __future__ import annotations

import math

import pytest
import torch

from llm_runtime.sampling import (
    Sampler,
    SamplingParams,
    apply_min_p,
    apply_penalties,
    apply_top_k,
    apply_top_k_top_p,
    apply_top_p,
)

# ---------------------------------------------------------------- validation

INVALID = [
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", "1"),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", -0.2), ("top_p", float("nan")),
    ("top_k", -2), ("top_k", 2.5), ("top_k", True),
    ("min_p", -0.1), ("min_p", 1.1), ("min_p", float("nan")),
    ("presence_penalty", 2.5), ("presence_penalty", -3.0), ("frequency_penalty", 2.1),
    ("frequency_penalty", float("nan")), ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("repetition_penalty", float("inf")),
    ("max_tokens", 0), ("max_tokens", -5), ("max_tokens", 3.0), ("max_tokens", "16"),
    ("min_tokens", -1), ("min_tokens", 1.5),
    ("n", 0), ("n", 1.0), ("seed", 1.5), ("seed", "42"),
    ("logprobs", -1), ("logprobs", 2.0),
    ("stop", ""), ("stop", [1, 2]), ("stop", ["ok", ""]), ("stop", 5),
    ("stop_token_ids", [-1]), ("stop_token_ids", ["a"]), ("stop_token_ids", 3),
    ("ignore_eos", 1), ("skip_special_tokens", "yes"),
]


@pytest.mark.parametrize("field,value", INVALID)
def test_invalid_field_is_rejected_by_name(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_cannot_exceed_max_tokens() -> None:
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_defaults_and_normalisation_follow_vllm() -> None:
    params = SamplingParams()
    assert (params.n, params.temperature, params.top_p, params.top_k, params.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (params.max_tokens, params.min_tokens, params.seed, params.logprobs) == (16, 0, None, None)
    assert params.stop == [] and params.stop_token_ids == []
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(temperature=0).is_greedy and not params.is_greedy
    assert SamplingParams(top_k=-1, max_tokens=None, temperature=2).top_k == -1


# ---------------------------------------------------------------- filters, exactly

PROBS = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
LOGITS = PROBS.log()[None]  # (1, 5)


def _kept(logits: torch.Tensor) -> list[int]:
    return torch.isfinite(logits[0]).nonzero().flatten().tolist()


def test_top_p_keeps_smallest_set_reaching_p_boundary_included() -> None:
    assert _kept(apply_top_p(LOGITS, torch.tensor([[0.6]]))) == [0, 1]  # 0.4 < 0.6 <= 0.7
    assert _kept(apply_top_p(LOGITS, torch.tensor([[0.75]]))) == [0, 1, 2]
    assert _kept(apply_top_p(LOGITS, torch.tensor([[0.1]]))) == [0]
    assert _kept(apply_top_p(LOGITS, torch.tensor([[1.0]]))) == [0, 1, 2, 3, 4]


def test_top_k_and_min_p_keep_the_right_tokens() -> None:
    assert _kept(apply_top_k(LOGITS, torch.tensor([[2]]))) == [0, 1]
    assert _kept(apply_top_k(LOGITS, torch.tensor([[5]]))) == [0, 1, 2, 3, 4]
    assert _kept(apply_min_p(LOGITS, torch.tensor([[0.3]]))) == [0, 1, 2]  # >= 0.12
    assert _kept(apply_min_p(LOGITS, torch.tensor([[0.0]]))) == [0, 1, 2, 3, 4]


def test_penalties_match_their_definitions() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    out = apply_penalties(
        logits,
        [SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)],
        output_token_ids=[[1, 1, 3]],
        prompt_token_ids=[[0]],
    )
    # token 0: prompt only -> 2/2; token 1: output twice -> -1*2 - 0.5*2 - 0.25; token 2 unseen;
    # token 3: output once -> 3/2 - 0.5 - 0.25
    assert torch.allclose(out, torch.tensor([[1.0, -3.25, 0.5, 0.75]]))


# ---------------------------------------------------------------- statistics

NUM_DRAWS = 40_000


def _empirical(params: SamplingParams, logits: torch.Tensor = LOGITS, seed: int = 0) -> torch.Tensor:
    """Frequencies of NUM_DRAWS draws, one per row of a batch of identical rows."""
    sampler = Sampler(seed=seed)
    batch = logits.expand(NUM_DRAWS, -1)
    tokens = sampler(batch, [params] * NUM_DRAWS).token_ids
    return torch.bincount(tokens, minlength=logits.shape[1]).double() / NUM_DRAWS


def _expected(weights: list[float]) -> torch.Tensor:
    w = torch.tensor(weights, dtype=torch.float64)
    return w / w.sum()


# 5 standard errors of a frequency near 0.5 over NUM_DRAWS draws: a correct sampler fails ~1 in 10^6 runs.
TOLERANCE = 5 * math.sqrt(0.25 / NUM_DRAWS)


@pytest.mark.parametrize(
    "params,weights",
    [
        (SamplingParams(temperature=1.0), [0.4, 0.3, 0.15, 0.1, 0.05]),
        (SamplingParams(temperature=0.5), [p**2 for p in [0.4, 0.3, 0.15, 0.1, 0.05]]),
        (SamplingParams(temperature=2.0), [p**0.5 for p in [0.4, 0.3, 0.15, 0.1, 0.05]]),
        (SamplingParams(top_k=2), [0.4, 0.3, 0, 0, 0]),
        (SamplingParams(top_p=0.6), [0.4, 0.3, 0, 0, 0]),
        (SamplingParams(top_p=0.8), [0.4, 0.3, 0.15, 0, 0]),
        (SamplingParams(min_p=0.3), [0.4, 0.3, 0.15, 0, 0]),
        (SamplingParams(min_p=0.5), [0.4, 0.3, 0, 0, 0]),
        (SamplingParams(top_k=3, top_p=0.7), [0.4, 0.3, 0, 0, 0]),  # top-p on the renormalised top-3
    ],
    ids=["t1", "t0.5", "t2", "topk2", "topp0.6", "topp0.8", "minp0.3", "minp0.5", "topk3+topp0.7"],
)
def test_sampled_frequencies_match_the_filtered_distribution(params: SamplingParams, weights: list[float]) -> None:
    freq = _empirical(params)
    expected = _expected(weights)
    assert (freq - expected).abs().max().item() < TOLERANCE
    assert torch.all(freq[expected == 0] == 0), "a filtered-out token was sampled"


def test_greedy_takes_the_argmax_and_ignores_filters() -> None:
    logits = torch.randn(8, 50)
    out = Sampler(seed=0)(logits, [SamplingParams(temperature=0, top_p=0.1, top_k=3)] * 8)
    assert torch.equal(out.token_ids, logits.argmax(-1))


def _run_rows(params: list[SamplingParams], logits_steps: list[torch.Tensor], rows: list[int]) -> list[list[int]]:
    """Sample several steps for the given rows, each with a fresh generator from its own seed."""
    sampler = Sampler(seed=123)
    generators = [params[r].make_generator() for r in rows]
    outputs: list[list[int]] = [[] for _ in rows]
    for logits in logits_steps:
        out = sampler(logits[rows], [params[r] for r in rows], generators, outputs)
        for j, token in enumerate(out.token_ids.tolist()):
            outputs[j].append(token)
    return outputs


def test_each_row_of_a_mixed_batch_gets_what_it_gets_alone() -> None:
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=1),
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.2, top_k=5, seed=2),
        SamplingParams(temperature=0.7, min_p=0.05, seed=3, frequency_penalty=0.5),
        SamplingParams(temperature=1.0, seed=4, repetition_penalty=1.3, presence_penalty=0.4),
    ]
    torch.manual_seed(0)
    steps = [torch.randn(len(params), 40) * 2 for _ in range(25)]
    together = _run_rows(params, steps, list(range(len(params))))
    for row in range(len(params)):
        alone = _run_rows(params, steps, [row])[0]
        assert together[row] == alone, f"row {row} changed when batched"
    # And a different order of the other rows changes nothing either.
    reordered = _run_rows(params, steps, [4, 2, 0, 3, 1])
    assert reordered[2] == together[0] and reordered[0] == together[4]


def test_same_seed_same_tokens_different_seed_different_tokens() -> None:
    torch.manual_seed(0)
    steps = [torch.randn(1, 1000) for _ in range(30)]
    first = _run_rows([SamplingParams(seed=7)], steps, [0])
    second = _run_rows([SamplingParams(seed=7)], steps, [0])
    other = _run_rows([SamplingParams(seed=8)], steps, [0])
    assert first == second and first != other


def test_logprobs_are_the_raw_distribution() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 30)
    params = [SamplingParams(temperature=0, logprobs=4), SamplingParams(temperature=0.5, seed=1),
              SamplingParams(temperature=0, logprobs=0)]
    out = Sampler(seed=0)(logits, params, [p.make_generator() for p in params])
    reference = logits.log_softmax(-1)
    assert torch.allclose(out.logprobs, reference.gather(1, out.token_ids[:, None]).squeeze(1))
    assert out.top_token_ids.shape == (3, 4)
    assert torch.equal(out.top_token_ids[0], reference[0].topk(4).indices)
    assert torch.allclose(out.top_logprobs[0], reference[0].topk(4).values)


def test_mismatched_params_count_is_an_error() -> None:
    with pytest.raises(ValueError, match="SamplingParams"):
        Sampler()(torch.randn(2, 10), [SamplingParams()])


def _full_sort_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The reference: top-k by a full sort of the vocabulary, then top-p by another."""
    kth_largest = logits.sort(dim=-1, descending=True).values.gather(1, top_k - 1)
    return apply_top_p(logits.masked_fill(logits < kth_largest, -math.inf), top_p)


@pytest.mark.parametrize("case", ["distinct", "ties", "top-p alone in some rows", "top-k alone in some rows"])
def test_top_k_then_top_p_on_candidates_equals_sorting_the_vocabulary(case: str) -> None:
    generator = torch.Generator().manual_seed(3)
    vocab = 300
    logits = torch.randn(16, vocab, generator=generator) * 3
    if case == "ties":  # coarse logits: many equal values, also at the top-k boundary
        logits = logits.round()
    top_k = torch.randint(1, 40, (16, 1), generator=generator)
    top_p = torch.rand(16, 1, generator=generator) * 0.9 + 0.05
    if case == "top-p alone in some rows":
        top_k[::3] = vocab
    if case == "top-k alone in some rows":
        top_p[::3] = 1.0
    expected = _full_sort_top_k_top_p(logits, top_k, top_p)
    assert torch.equal(apply_top_k_top_p(logits, top_k, top_p), expected)
    assert torch.equal(apply_top_k(logits, top_k), _full_sort_top_k_top_p(logits, top_k, torch.ones(16, 1)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_greedy_in_the_model_dtype_takes_the_first_of_equal_maxima(dtype: torch.dtype) -> None:
    logits = torch.zeros(64, 1000, dtype=dtype)
    for row in range(64):  # the maximum twice in every row: argmax's answer is the first
        logits[row, [row * 7, row * 7 + 1 + row]] = 1.0
    params = [SamplingParams(temperature=0.0)] * 64
    out = Sampler(seed=0)(logits, params)
    assert torch.equal(out.token_ids, logits.float().argmax(dim=-1))


def test_counts_kept_on_the_device_equal_counts_from_the_lists() -> None:
    from llm_runtime.sampling.token_counts import TokenCounts

    rng = torch.Generator().manual_seed(5)
    vocab, batch = 50, 6
    prompts = [torch.randint(0, vocab, (int(n),), generator=rng).tolist() for n in torch.randint(1, 20, (batch,), generator=rng)]
    outputs: list[list[int]] = [[] for _ in range(batch)]
    counts = [TokenCounts(p, vocab, "cpu") if row % 3 else None for row, p in enumerate(prompts)]  # some rows without
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2)
              if row % 3 else SamplingParams(temperature=0.0) for row in range(batch)]
    sampler = Sampler(seed=0)
    for _ in range(5):  # the counts follow the outputs step by step, a few tokens at a time
        for row in range(batch):
            outputs[row] += torch.randint(0, vocab, (int(torch.randint(0, 3, (), generator=rng)),), generator=rng).tolist()
            if counts[row] is not None:
                counts[row].update(outputs[row])
        logits = torch.randn(batch, vocab, generator=rng) * 3
        from_lists = apply_penalties(logits, params, outputs, prompts)
        on_device = sampler(logits, params, output_token_ids=[[]] * batch, prompt_token_ids=[[]] * batch,
                            token_counts=counts)
        assert torch.equal(on_device.token_ids, from_lists.argmax(dim=-1))
        assert torch.equal(sampler(logits, params, output_token_ids=outputs, prompt_token_ids=prompts).token_ids,
                           on_device.token_ids)
