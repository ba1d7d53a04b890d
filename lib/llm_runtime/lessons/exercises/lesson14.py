"""Lesson 14 exercises: prompt lookup, greedy verification of drafts, and what an acceptance rate is worth.

- `propose(token_ids, num_tokens, max_n)`: the n-gram proposer's guesses, against `spec_decode.propose_ngram`.
- `verify_greedy(draft_token_ids, logits)`: the tokens a greedy request emits after one verification, against
  `sampling.rejection.rejection_sample` with one-hot targets (what the engine does for greedy requests).
- `tokens_per_verification(acceptance_rate, k)`: the expected tokens gained per verification, against
  `spec_decode.expected_tokens_per_verification`.
"""

from __future__ import annotations

import random

import torch

from ...sampling.rejection import one_hot_greedy, rejection_sample
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


def _greedy_reference(drafts: list[int], logits: torch.Tensor) -> list[int]:
    k = len(drafts)
    out = rejection_sample(one_hot_greedy(logits)[None], torch.tensor([drafts], dtype=torch.long).reshape(1, k),
                           None, torch.full((1, k), 0.5), torch.ones(1, k + 1, logits.shape[-1]))
    return [int(t) for t in out.token_ids[0] if t >= 0]


def check_verify_greedy(fn: object) -> Verdict:
    """`verify_greedy(draft_token_ids, logits) -> list[int]`: k drafted tokens and the target's logits (k + 1,
    vocab) at each drafted position and one past the last. Keep drafts while each is the argmax of its row;
    then emit the argmax of the next row (the replacement of the first wrong draft, or the bonus after the
    last). Return the kept drafts followed by that token."""

    def cases() -> list[Case]:
        generator = torch.Generator().manual_seed(14)
        out = []
        for k, agree, note in [(3, 3, "all kept: the bonus"), (3, 0, "the first is wrong"), (4, 2, "two kept"),
                               (1, 1, "one draft, kept"), (0, 0, "no draft: a plain decode")]:
            logits = torch.randn(k + 1, 11, generator=generator)
            best = logits.argmax(dim=-1).tolist()
            drafts = best[:agree] + [(b + 1) % 11 for b in best[agree:k]]
            out.append(Case({"draft_token_ids": drafts, "logits": logits}, _greedy_reference(drafts, logits), note))
        logits = torch.randn(4, 11, generator=generator)
        best = logits.argmax(dim=-1).tolist()
        drafts = [best[0], (best[1] + 1) % 11, best[2]]  # right, wrong, right: what follows a wrong guess is void
        out.append(Case({"draft_token_ids": drafts, "logits": logits}, _greedy_reference(drafts, logits),
                        "a right guess after a wrong one"))
        return out

    return run_cases("verify_greedy", fn, cases, same_value,
                     "llm_runtime.sampling.rejection.rejection_sample (one-hot targets)")


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
