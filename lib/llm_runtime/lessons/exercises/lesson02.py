"""Lesson 02 exercises: the sampler's filters and penalties, on a batch, checked against `sampling/sampler.py`.

- `top_p_filter(logits, top_p)`: nucleus filtering with one `top_p` per row, against `apply_top_p`.
- `top_k_filter(logits, top_k)`: top-k with ties at the boundary kept, against `apply_top_k`.
- `apply_penalties(logits, prompt_token_ids, output_token_ids, repetition_penalties,
  frequency_penalties, presence_penalties)`: vLLM's three penalties, against `apply_penalties`.
"""

from __future__ import annotations

import random

import torch

from ...sampling import SamplingParams, apply_penalties, apply_top_k, apply_top_p
from .check import Case, Verdict, close_tensors, kept_tokens, run_cases

_BOUNDARY_MARGIN = 1e-4  # top-p cases keep every cumulative mass this far from the cut, so rounding cannot decide


def _clear_of_the_boundary(logits: torch.Tensor, top_p: torch.Tensor) -> bool:
    """No row has a token whose cumulative mass is within rounding distance of 1 - top_p."""
    ascending = logits.double().sort(dim=-1).values.softmax(dim=-1).cumsum(dim=-1)  # (B, V)
    return bool(((ascending - (1 - top_p.double())).abs() > _BOUNDARY_MARGIN).all())


def check_top_p_filter(fn: object) -> Verdict:
    """`top_p_filter(logits, top_p) -> Tensor`: logits (B, V) float32, top_p (B, 1) in (0, 1]; keep in each
    row the smallest set of most likely tokens whose probability reaches that row's top_p (the token
    that crosses it included), set the others to -inf, and leave the kept logits unchanged."""

    def cases() -> list[Case]:
        rng, generator = random.Random(2), torch.Generator().manual_seed(2)
        out = []
        hand = [([[3.0, 1.0, 0.2, -1.0]], [[0.5]]), ([[2.0, 1.9, 1.8, -3.0]], [[0.7]]),
                ([[0.0, 0.0, 5.0, 1.0]], [[1.0]]), ([[1.0, 2.0, 3.0, 4.0, 5.0]], [[0.01]])]
        for logits, top_p in hand:
            logits, top_p = torch.tensor(logits), torch.tensor(top_p)
            out.append(Case({"logits": logits, "top_p": top_p}, apply_top_p(logits, top_p)))
        while len(out) < 40:
            batch, vocab = rng.randint(1, 4), rng.randint(3, 10)
            logits = torch.randn(batch, vocab, generator=generator) * rng.choice([0.5, 1.0, 3.0])
            top_p = torch.tensor([[rng.choice([rng.uniform(0.05, 0.99), 1.0, 0.9, 0.5])] for _ in range(batch)])
            if _clear_of_the_boundary(logits, top_p):
                out.append(Case({"logits": logits, "top_p": top_p}, apply_top_p(logits, top_p)))
        return out

    return run_cases("top_p_filter", fn, cases, kept_tokens, "llm_runtime.sampling.apply_top_p")


def check_top_k_filter(fn: object) -> Verdict:
    """`top_k_filter(logits, top_k) -> Tensor`: logits (B, V) float32, top_k (B, 1) int64 in [1, V]; keep in
    each row every token whose logit is at least that row's k-th largest (so tokens tied with the k-th
    all stay), set the others to -inf, and leave the kept logits unchanged."""

    def cases() -> list[Case]:
        rng = random.Random(2)
        out = []
        hand = [([[1.0, 3.0, 2.0, 0.0]], [[2]]), ([[2.0, 2.0, 1.0, 2.0]], [[1]]), ([[0.0, 1.0, 1.0, 0.0]], [[2]])]
        for logits, top_k in hand:
            logits, top_k = torch.tensor(logits), torch.tensor(top_k)
            out.append(Case({"logits": logits, "top_k": top_k}, apply_top_k(logits, top_k)))
        for _ in range(30):
            batch, vocab = rng.randint(1, 4), rng.randint(2, 9)
            # Small integers: ties are common, and some fall on the boundary.
            logits = torch.tensor([[float(rng.randint(-2, 2)) for _ in range(vocab)] for _ in range(batch)])
            top_k = torch.tensor([[rng.randint(1, vocab)] for _ in range(batch)])
            out.append(Case({"logits": logits, "top_k": top_k}, apply_top_k(logits, top_k)))
        return out

    return run_cases("top_k_filter", fn, cases, kept_tokens, "llm_runtime.sampling.apply_top_k")


def check_apply_penalties(fn: object) -> Verdict:
    """`apply_penalties(logits, prompt_token_ids, output_token_ids, repetition_penalties, frequency_penalties,
    presence_penalties) -> Tensor`: logits (B, V) float32; per row a list of prompt token ids, a list of
    output token ids, and three floats (lists of length B). As vLLM: every token seen in the prompt or the
    output has its logit divided by the repetition penalty if positive, multiplied by it if not; then
    each output token's logit goes down by frequency_penalty x its count in the output and by
    presence_penalty once if it occurs there at all. Returns new logits (B, V)."""

    def cases() -> list[Case]:
        rng, generator = random.Random(2), torch.Generator().manual_seed(2)
        out = []
        for number in range(30):
            batch, vocab = rng.randint(1, 3), rng.randint(4, 9)
            logits = torch.randn(batch, vocab, generator=generator) * 2
            prompts = [[rng.randrange(vocab) for _ in range(rng.randint(0, 4))] for _ in range(batch)]
            outputs = [[rng.randrange(vocab) for _ in range(rng.randint(0, 6))] for _ in range(batch)]
            repetition = [rng.choice([1.0, 1.1, 1.5, 2.0, 0.8]) for _ in range(batch)]
            frequency = [rng.choice([0.0, 0.5, -0.3, 1.0]) for _ in range(batch)]
            presence = [rng.choice([0.0, 0.3, -0.5, 1.2]) for _ in range(batch)]
            if number < 3:  # one penalty at a time first: a failure then says which one is wrong
                only = [(1.5, 0.0, 0.0), (1.0, 0.5, 0.0), (1.0, 0.0, 0.7)][number]
                repetition, frequency, presence = ([value] * batch for value in only)
            params = [SamplingParams(repetition_penalty=r, frequency_penalty=f, presence_penalty=p)
                      for r, f, p in zip(repetition, frequency, presence)]
            expected = apply_penalties(logits, params, outputs, prompts)
            out.append(Case({"logits": logits, "prompt_token_ids": prompts, "output_token_ids": outputs,
                             "repetition_penalties": repetition, "frequency_penalties": frequency,
                             "presence_penalties": presence}, expected))
        return out

    return run_cases("apply_penalties", fn, cases, close_tensors(rtol=1e-5, atol=1e-5),
                     "llm_runtime.sampling.apply_penalties")
