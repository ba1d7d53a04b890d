"""The seeded generator: exact 32-bit arithmetic, Exp(1) noise, and seeded rows drawing the right distribution."""

from __future__ import annotations

import math

import pytest
import torch

from llm_runtime import Sampler, SamplingParams
from llm_runtime.sampling.seeded import SeededGenerator, _mul32, exponential_noise, hash32, seeded_noise


def test_multiplication_mod_2_32_is_exact_without_overflow() -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randint(0, 2**32, (10_000,), generator=generator, dtype=torch.int64),
                   torch.tensor([0, 1, 2**31, 2**32 - 1])])
    for constant in (0x7FEB352D, 0x846CA68B, 0xFFFFFFFF, 1):
        expected = torch.tensor([(v * constant) % 2**32 for v in x.tolist()])
        assert torch.equal(_mul32(x, constant), expected)


def test_the_hash_is_a_bijection_that_mixes_its_bits() -> None:
    x = torch.arange(2**16, dtype=torch.int64)
    hashed = hash32(x)
    assert hashed.unique().numel() == 2**16 and int(hashed.min()) >= 0 and int(hashed.max()) < 2**32
    # Flipping one input bit flips about half of the output bits (avalanche).
    flipped = hash32(x ^ 1)
    bits = torch.stack([((hashed ^ flipped) >> b) & 1 for b in range(32)]).double()
    assert abs(bits.mean().item() - 0.5) < 0.01


def test_noise_is_exponential_and_independent_across_draws_and_seeds() -> None:
    seeds = torch.tensor([0, 1, -5, 2**62 + 3], dtype=torch.int64)
    noise = exponential_noise(seeds.repeat_interleave(50), torch.arange(50).repeat(4), 1000)  # (200, 1000)
    assert noise.dtype == torch.float32 and bool((noise > 0).all()) and bool(noise.isfinite().all())
    assert noise.mean().item() == pytest.approx(1.0, abs=0.01)  # Exp(1): mean 1, variance 1
    assert noise.var().item() == pytest.approx(1.0, abs=0.03)
    flat = noise - noise.mean()
    for a, b in ((flat[:-1], flat[1:]), (flat[:, :-1], flat[:, 1:])):  # neighbouring draws, neighbouring tokens
        correlation = (a * b).mean() / flat.var()
        assert abs(correlation.item()) < 0.01
    again = exponential_noise(seeds, torch.zeros(4, dtype=torch.int64), 1000)
    assert torch.equal(again, noise[::50])  # a pure function of (seed, draw, token)


def test_a_generator_advances_one_draw_per_call() -> None:
    generators = [SeededGenerator(3), SeededGenerator(3)]
    generators[1].draws = 5
    noise = seeded_noise(generators, 64, torch.device("cpu"))
    assert [g.draws for g in generators] == [1, 6]
    assert torch.equal(noise, exponential_noise(torch.tensor([3, 3]), torch.tensor([0, 5]), 64))


NUM_DRAWS = 40_000
TOLERANCE = 5 * math.sqrt(0.25 / NUM_DRAWS)  # 5 standard errors of a frequency near 0.5
LOGITS = torch.tensor([[0.4, 0.3, 0.15, 0.1, 0.05]]).log()


@pytest.mark.parametrize("params,weights", [
    (SamplingParams(temperature=1.0), [0.4, 0.3, 0.15, 0.1, 0.05]),
    (SamplingParams(temperature=0.5), [p**2 for p in [0.4, 0.3, 0.15, 0.1, 0.05]]),
    (SamplingParams(top_k=3, top_p=0.7), [0.4, 0.3, 0, 0, 0]),
], ids=["t1", "t0.5", "topk3+topp0.7"])
@pytest.mark.parametrize("across", ["seeds", "draws"])
def test_seeded_rows_draw_the_filtered_distribution(params: SamplingParams, weights: list[float], across: str) -> None:
    """Many seeds in one batch, or one seed's successive draws: the frequencies are the distribution's."""
    if across == "seeds":
        generators = [SeededGenerator(seed) for seed in range(NUM_DRAWS)]
    else:
        generators = [SeededGenerator(7) for _ in range(NUM_DRAWS)]
        for draw, generator in enumerate(generators):
            generator.draws = draw
    tokens = Sampler(seed=0)(LOGITS.expand(NUM_DRAWS, -1), [params] * NUM_DRAWS, generators).token_ids
    frequencies = torch.bincount(tokens, minlength=5).double() / NUM_DRAWS
    expected = torch.tensor(weights, dtype=torch.float64) / sum(weights)
    assert (frequencies - expected).abs().max().item() < TOLERANCE
    assert torch.all(frequencies[expected == 0] == 0)


def test_a_torch_generator_is_refused_with_a_hint() -> None:
    with pytest.raises(TypeError, match="SeededGenerator"):
        Sampler()(LOGITS, [SamplingParams(seed=1)], [torch.Generator().manual_seed(1)])
