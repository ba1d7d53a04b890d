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

Randomness comes from the caller (the uniforms and the race noise), so seeded requests draw from their
own generators, as in `Sampler`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
