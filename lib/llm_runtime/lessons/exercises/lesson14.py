"""Lesson 14 exercises: prompt lookup, verifying sampled drafts, and what an acceptance rate is worth.

- `propose(token_ids, num_tokens, max_n)`: the n-gram proposer's guesses, against `spec_decode.propose_ngram`.
- `verify_sampled(draft_token_ids, target_probs, draft_probs, uniform, noise)`: the tokens a sampled request
  emits after one verification (the rejection rule of section 3), against `sampling.rejection.rejection_sample`
  given the same random numbers.
- `tokens_per_verification(acceptance_rate, k)`: the expected tokens gained per verification, against
  `spec_decode.expected_tokens_per_verification`.
"""

from __future__ import annotations

import random

import torch

from ...sampling.rejection import rejection_sample
from ...spec_decode import expected_tokens_per_verification, propose_ngram
from .check import Case, Verdict, close_numbers, run_cases, same_value


def check_propose(fn: object) -> Verdict:
    """`propose(token_ids, num_tokens, max_n) -> list[int]`: for n from min(max_n, len - 1) down to 1, look for
    the last n tokens earlier in `token_ids` (an occurrence that starts before the suffix itself); at the
    first n that has one, return up to `num_tokens` tokens that followed its first occurrence. No match at
    any n: []."""

    def cases() -> list[Case]:
        rng = random.Random(14)
        inputs = [([1, 2, 3, 4, 1, 2], 3, 2, "the lesson's example"),
                  ([5, 6, 5, 6, 5], 4, 3, "periodic text: the first occurrence has the most after it"),
                  ([1, 2, 3], 2, 3, "nothing repeats"),
                  ([7], 2, 2, "one token"),
                  ([1, 9, 2, 9, 1, 9], 2, 2, "the longer match wins over the first one"),
                  ([4, 4, 4, 4], 3, 1, "a run of one token")]
        for _ in range(40):
            vocab = rng.randint(2, 6)
            tokens = [rng.randrange(vocab) for _ in range(rng.randint(2, 25))]
            inputs.append((tokens, rng.randint(1, 5), rng.randint(1, 4), ""))
        return [Case({"token_ids": t, "num_tokens": k, "max_n": n}, propose_ngram(t, k, n), note)
                for t, k, n, note in inputs]

    return run_cases("propose", fn, cases, same_value, "llm_runtime.spec_decode.propose_ngram")


def _sampled_reference(drafts: list[int], target_probs: torch.Tensor, draft_probs: torch.Tensor,
                       uniform: torch.Tensor, noise: torch.Tensor) -> list[int]:
    k = len(drafts)
    out = rejection_sample(target_probs[None], torch.tensor([drafts], dtype=torch.long).reshape(1, k),
                           draft_probs[None], uniform[None], noise[None])
    return [int(t) for t in out.token_ids[0] if t >= 0]


def check_verify_sampled(fn: object) -> Verdict:
    """`verify_sampled(draft_token_ids, target_probs, draft_probs, uniform, noise) -> list[int]`: k drafted
    tokens d_i; the target's probabilities p (k + 1, vocab) at each drafted position and one past the last;
    the drafter's q (k, vocab); uniform (k,) in (0, 1); noise (k + 1, vocab), Exp(1) draws. For i = 0, 1, ...:
    keep d_i if uniform[i] * q[i, d_i] < p[i, d_i]; at the first rejection, emit the replacement, the argmax of
    residual / noise[i] where residual = max(0, p[i] - q[i]) (p[i] itself if that is all zeros), and stop. If
    every draft is kept, emit the bonus, the argmax of p[k] / noise[k]. Return the kept drafts and that token."""

    def cases() -> list[Case]:
        generator = torch.Generator().manual_seed(14)
        out = []
        for k, vocab, sharpness, note in [(3, 6, 1.0, "a flat target"), (4, 8, 3.0, "a peaked target"),
                                          (1, 5, 1.0, "one draft"), (0, 5, 1.0, "no draft: a plain sample"),
                                          *[(3, 6, 2.0, "") for _ in range(40)]]:
            p = (sharpness * torch.randn(k + 1, vocab, generator=generator, dtype=torch.float64)).softmax(-1)
            q = (sharpness * torch.randn(k, vocab, generator=generator, dtype=torch.float64)).softmax(-1)
            drafts = [int(torch.multinomial(row, 1, generator=generator)) for row in q]  # what the drafter drew
            uniform = torch.rand(k, generator=generator, dtype=torch.float64)
            noise = torch.empty(k + 1, vocab, dtype=torch.float64).exponential_(generator=generator)
            out.append(Case({"draft_token_ids": drafts, "target_probs": p, "draft_probs": q, "uniform": uniform,
                             "noise": noise}, _sampled_reference(drafts, p, q, uniform, noise), note))
        # The drafter and the target agree exactly: every draft is kept, whatever the uniform draws.
        p = torch.full((3, 4), 0.25, dtype=torch.float64)
        out.append(Case({"draft_token_ids": [1, 2], "target_probs": p, "draft_probs": p[:2].clone(),
                         "uniform": torch.tensor([0.99, 0.5], dtype=torch.float64),
                         "noise": torch.ones(3, 4, dtype=torch.float64)},
                        _sampled_reference([1, 2], p, p[:2].clone(), torch.tensor([0.99, 0.5], dtype=torch.float64),
                                           torch.ones(3, 4, dtype=torch.float64)), "q = p: all kept"))
        return out

    return run_cases("verify_sampled", fn, cases, same_value,
                     "llm_runtime.sampling.rejection.rejection_sample (the same uniform and noise draws)")


def check_tokens_per_verification(fn: object) -> Verdict:
    """`tokens_per_verification(acceptance_rate, k) -> float`: each of k drafts is kept with probability
    `acceptance_rate` if all before it were; a verification emits the kept drafts and one token more. Return
    the expected number of tokens it emits."""
    cases = [Case({"acceptance_rate": a, "k": k}, expected_tokens_per_verification(a, k), note)
             for a, k, note in [(0.0, 4, "nothing kept: one token, as without speculation"),
                                (1.0, 4, "everything kept"), (0.5, 1, ""), (0.7, 4, ""), (0.9, 8, ""),
                                (0.3, 0, "no drafts")]]
    return run_cases("tokens_per_verification", fn, cases, close_numbers(rel_tol=1e-9),
                     "llm_runtime.spec_decode.expected_tokens_per_verification")
