"""Rejection sampling for speculative decoding: keep a batch of drafted tokens so that what comes out is
distributed exactly as the target model alone would have sampled it (lesson 14).

A proposer drafts k tokens d_1 .. d_k for a sequence, d_i drawn from its own distribution q_i (for an
n-gram proposer q_i is one-hot: it is sure). The target model scores all of them in one forward pass,
which gives its distributions p_1 .. p_{k+1} at each drafted position and one past the last (after the
request's temperature, top-k, top-p and penalties: the distributions it would sample from). Then, in
order:

- keep d_i with probability min(1, p_i(d_i) / q_i(d_i)), by a uniform u_i: keep when u_i q_i(d_i) < p_i(d_i);
- at the first rejection, draw the replacement from the residual max(0, p_i - q_i), normalized, and stop;
- if every draft was kept, draw a bonus token from p_{k+1}.

Why it is exact, for one position (Leviathan et al. 2023, Chen et al. 2023): token x comes out either as
a kept draft, with probability q(x) min(1, p(x)/q(x)) = min(q(x), p(x)), or as a replacement, with
probability P(reject) * max(0, p(x) - q(x)) / Z. P(reject) = 1 - sum_x min(p(x), q(x)) = Z, the
residual's total mass, so the two add up to min(p, q) + max(0, p - q) = p(x). Each later position is the
same argument given the tokens before it. Greedy requests pass one-hot p (their argmax): a draft is kept
exactly when it is the argmax, and the replacement is the argmax, so greedy output is unchanged.

Randomness comes from the caller (the uniforms and the race noise), as in `Sampler`.

A seeded request is verified otherwise (`RejectionSampler`): its token at each position is the one its own
sampler would draw there without speculation (the exponential race over p with its seed's noise at that draw),
and a draft is kept exactly when it is that token. Its output is then a function of its prompt, its parameters
and the target model alone: what the drafts were, or what batch drew them, changes how many tokens a step
emits, never which. (Rejection sampling keeps the distribution exact, but which tokens come out depends on q
too, and a draft model's q moves with the rounding of whatever batch it ran in.) The draft model draws a seeded
request's guesses with the same noise (spec_decode/draft_model.py), so where q is close to p its guess wins
the same race, and is kept.

`RejectionSampler` does this for an engine step's speculating sequences, each with its own request
(module docstring of the class).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .params import SamplingParams
from .sampler import Sampler, penalized_logits, sampling_probs
from .seeded import SeededGenerator, exponential_noise


@dataclass(frozen=True)
class RejectionOutput:
    token_ids: torch.Tensor  # (B, k + 1) int64: the kept drafts, then the replacement or bonus; -1 after that
    num_accepted: torch.Tensor  # (B,) int64 in 0 .. k: drafts kept; each row emits num_accepted + 1 tokens


def rejection_sample(target_probs: torch.Tensor, draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None,
                     uniform: torch.Tensor, noise: torch.Tensor, num_drafts: torch.Tensor | None = None) -> RejectionOutput:
    """The tokens a batch of speculating sequences emits this step.

    target_probs (B, k + 1, V): the target's distribution at each drafted position and one past the last;
    draft_token_ids (B, k) int64; draft_probs (B, k, V), or None for one-hot drafts (an n-gram proposer);
    uniform (B, k) in (0, 1) for the keep-or-reject tests; noise (B, k + 1, V) Exp(1), for the draw of the
    replacement or bonus token (an exponential race, as `Sampler` draws); num_drafts (B,) int64, each row's
    real draft count (a row with fewer than k pads the rest; its bonus comes from target_probs[num_drafts]).
    """
    batch, positions, vocab = target_probs.shape
    k = positions - 1
    if draft_token_ids.shape != (batch, k) or uniform.shape != (batch, k) or noise.shape != target_probs.shape:
        raise ValueError(f"for target_probs {tuple(target_probs.shape)}: draft_token_ids and uniform must be "
                         f"{(batch, k)} and noise {tuple(target_probs.shape)}; got {tuple(draft_token_ids.shape)}, "
                         f"{tuple(uniform.shape)}, {tuple(noise.shape)}")
    if draft_probs is not None and draft_probs.shape != (batch, k, vocab):
        raise ValueError(f"draft_probs must be {(batch, k, vocab)}, got {tuple(draft_probs.shape)}")
    device = target_probs.device
    if num_drafts is None:
        num_drafts = torch.full((batch,), k, dtype=torch.long, device=device)
    drafts = draft_token_ids[..., None]  # (B, k, 1)
    p_draft = target_probs[:, :k].gather(-1, drafts).squeeze(-1)  # (B, k): p_i(d_i)
    q_draft = torch.ones_like(p_draft) if draft_probs is None else draft_probs.gather(-1, drafts).squeeze(-1)
    real = torch.arange(k, device=device)[None] < num_drafts[:, None]  # (B, k): drafts, not padding
    kept = (uniform * q_draft < p_draft) & real  # (B, k)
    num_accepted = kept.long().cumprod(dim=-1).sum(dim=-1)  # (B,): the kept prefix's length

    # The residual max(0, p_i - q_i) at each drafted position; past the last real draft, p itself (the bonus).
    if draft_probs is None:
        q_full = torch.zeros_like(target_probs[:, :k]).scatter_(-1, drafts, 1.0)  # (B, k, V) one-hot
    else:
        q_full = draft_probs
    residual = target_probs.clone()  # (B, k + 1, V)
    residual[:, :k] = torch.where(real[..., None], (target_probs[:, :k] - q_full).clamp_min(0), target_probs[:, :k])
    # A rejection where p and q agree up to rounding leaves no mass: draw from p there.
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, target_probs, residual)
    drawn = (residual / noise.clamp_min(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)  # (B, k + 1)
    last = drawn.gather(1, num_accepted[:, None]).squeeze(1)  # (B,): the replacement or the bonus

    column = torch.arange(k + 1, device=device)[None]  # (1, k + 1)
    padded_drafts = torch.cat([draft_token_ids, draft_token_ids.new_full((batch, 1), -1)], dim=1)
    token_ids = torch.where(column < num_accepted[:, None], padded_drafts,
                            torch.where(column == num_accepted[:, None], last[:, None], -1))
    return RejectionOutput(token_ids, num_accepted)


def one_hot_greedy(logits: torch.Tensor) -> torch.Tensor:
    """(..., V) logits -> one-hot (..., V) float32 at the argmax (the first of equal maxima, as `Sampler`'s
    greedy rows): what a greedy request passes as its target distribution."""
    index = logits.max(dim=-1).indices
    return torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter_(-1, index[..., None], 1.0)


@dataclass(frozen=True)
class VerifiedDrafts:
    """Per speculating sequence: the drafts it keeps, then the token drawn after them."""

    accepted: list[list[int]]  # a prefix of each sequence's drafts
    next_token_ids: list[int]  # the replacement of the first rejected draft, or the bonus after the last


class RejectionSampler:
    """Verifies the drafts of a step's speculating sequences against the target model's logits.

    Sequence i brings k_i drafts and k_i + 1 rows of logits: the target's at each drafted position and one
    past the last. Row j is what the `Sampler` would sample output token n_i + j from, n_i being the
    sequence's output so far and drafts 0 .. j - 1 taken as output: the request's blocked tokens (EOS before
    `min_tokens`) and penalties with those drafts counted, then temperature, min-p, top-k and top-p.
    Greedy sequences keep the longest prefix of drafts that are the argmaxes, and emit the argmax after it.
    Seeded ones do the same with the token their sampler draws at each row (the exponential race with noise from
    their seed at draw n_i + j: module docstring). The others go through `rejection_sample`, with Exp(1) noise
    from this sampler's generator; each position's keep-or-reject uniform comes from that position's noise at
    the drafted token, u = 1 - exp(-E): a rejected draft has no residual mass (p < q there), so the
    replacement's race never reads it, and the two stay independent.
    """

    def __init__(self, sampler: Sampler) -> None:
        self.generator = sampler.generator

    def __call__(
        self,
        logits: torch.Tensor,
        drafts: Sequence[Sequence[int]],
        draft_probs: Sequence[torch.Tensor | None],
        params: Sequence[SamplingParams],
        generators: Sequence[SeededGenerator | None],
        output_token_ids: Sequence[Sequence[int]],
        prompt_token_ids: Sequence[Sequence[int]],
        blocked_token_ids: Sequence[Sequence[int]],
    ) -> VerifiedDrafts:
        """logits (sum of k_i + 1, V), sequence after sequence; per sequence its drafts (k_i,), their draft
        distributions (k_i, V) (None: sure guesses, an n-gram's), its params, generator, output and prompt
        tokens, and the tokens blocked at its next output position (checked against min_tokens per row)."""
        num_rows = [len(d) + 1 for d in drafts]
        if logits.shape[0] != sum(num_rows):
            raise ValueError(f"{logits.shape[0]} rows of logits for drafts needing {sum(num_rows)}")
        # One row per (sequence, position), with that position's output so far and blocked tokens.
        row_params = [p for p, n in zip(params, num_rows) for _ in range(n)]
        row_outputs = row_prompts = None  # only penalties read them: no copy of every output per row otherwise
        if any(p.has_penalties for p in params):
            row_outputs = [list(out) + list(d[:j]) for out, d, n in zip(output_token_ids, drafts, num_rows)
                           for j in range(n)]
            row_prompts = [prompt for prompt, n in zip(prompt_token_ids, num_rows) for _ in range(n)]
        row_blocked = [tuple(blocked) if len(out) + j < p.min_tokens else ()
                       for blocked, out, p, n in zip(blocked_token_ids, output_token_ids, params, num_rows)
                       for j in range(n)]
        logits = penalized_logits(logits, row_params, row_outputs, row_prompts, row_blocked)
        starts = [sum(num_rows[:i]) for i in range(len(num_rows))]
        accepted: list[list[int]] = [[] for _ in drafts]
        next_tokens = [0] * len(drafts)

        greedy = [i for i, p in enumerate(params) if p.is_greedy]
        if greedy:
            best = logits.max(dim=-1).indices.tolist()  # the first of equal maxima, as the Sampler's
            for i in greedy:
                argmaxes = best[starts[i] : starts[i] + num_rows[i]]
                kept = 0
                while kept < len(drafts[i]) and drafts[i][kept] == argmaxes[kept]:
                    kept += 1
                accepted[i], next_tokens[i] = list(drafts[i][:kept]), argmaxes[kept]
        seeded = [i for i, p in enumerate(params) if not p.is_greedy and generators[i] is not None]
        if seeded:
            self._verify_seeded(logits, seeded, starts, num_rows, drafts, params, generators, output_token_ids,
                                accepted, next_tokens)
        sampled = [i for i, p in enumerate(params) if not p.is_greedy and generators[i] is None]
        if sampled:
            self._verify_sampled(logits, sampled, starts, num_rows, drafts, draft_probs, params, output_token_ids,
                                 accepted, next_tokens)
        return VerifiedDrafts(accepted, next_tokens)

    def _verify_seeded(self, logits, seeded, starts, num_rows, drafts, params, generators, output_token_ids,
                       accepted, next_tokens) -> None:
        """Each seeded sequence's own draws at its rows (its seed's noise at draws n_i + j); the drafts kept are
        the longest prefix equal to them, then the draw after."""
        device, vocab = logits.device, logits.shape[1]
        rows = [starts[i] + j for i in seeded for j in range(num_rows[i])]
        probs = sampling_probs(logits[torch.tensor(rows, device=device)],
                               [params[i] for i in seeded for _ in range(num_rows[i])])  # (rows, V)
        seeds, draws = zip(*[(generators[i].seed, len(output_token_ids[i]) + j)
                             for i in seeded for j in range(num_rows[i])])
        noise = exponential_noise(torch.tensor(seeds, dtype=torch.int64, device=device),
                                  torch.tensor(draws, dtype=torch.int64, device=device), vocab)
        drawn = (probs / noise.clamp_min(torch.finfo(noise.dtype).tiny)).argmax(dim=-1).tolist()  # one sync
        offset = 0
        for i in seeded:
            own = drawn[offset : offset + num_rows[i]]
            kept = 0
            while kept < len(drafts[i]) and drafts[i][kept] == own[kept]:
                kept += 1
            accepted[i], next_tokens[i] = list(drafts[i][:kept]), own[kept]
            offset += num_rows[i]

    def _verify_sampled(self, logits, sampled, starts, num_rows, drafts, draft_probs, params, output_token_ids,
                        accepted, next_tokens) -> None:
        """Unseeded sequences: `rejection_sample`, with noise from this sampler's generator."""
        device, vocab = logits.device, logits.shape[1]
        k = max(num_rows[i] for i in sampled) - 1
        rows = [starts[i] + j for i in sampled for j in range(num_rows[i])]
        probs = sampling_probs(logits[torch.tensor(rows, device=device)],
                               [params[i] for i in sampled for _ in range(num_rows[i])])  # (rows, V)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        # Padded to k drafts per sequence: (B, k + 1, V) targets and noise, (B, k) drafts.
        batch = len(sampled)
        target = probs.new_zeros(batch, k + 1, vocab)
        race = noise.new_ones(batch, k + 1, vocab)
        draft_ids = torch.zeros(batch, k, dtype=torch.int64, device=device)
        dense_drafts = None if all(draft_probs[i] is None for i in sampled) else probs.new_zeros(batch, k, vocab)
        offset = 0
        for b, i in enumerate(sampled):
            n = num_rows[i]
            target[b, :n], race[b, :n] = probs[offset : offset + n], noise[offset : offset + n]
            target[b, n:] = target[b, n - 1]  # padding past the bonus: never read
            if n > 1:
                draft_ids[b, : n - 1] = torch.tensor(list(drafts[i]), device=device)
                if dense_drafts is not None:
                    dense_drafts[b, : n - 1] = (draft_probs[i] if draft_probs[i] is not None else
                                                torch.nn.functional.one_hot(draft_ids[b, : n - 1], vocab).float())
            offset += n
        uniform = 1 - torch.exp(-race[:, :k].gather(-1, draft_ids[..., None]).squeeze(-1))  # (B, k)
        num_drafts = torch.tensor([num_rows[i] - 1 for i in sampled], device=device)
        out = rejection_sample(target, draft_ids, dense_drafts, uniform, race, num_drafts)
        num_kept, tokens = out.num_accepted.tolist(), out.token_ids.tolist()
        for b, i in enumerate(sampled):
            accepted[i], next_tokens[i] = tokens[b][: num_kept[b]], tokens[b][num_kept[b]]
