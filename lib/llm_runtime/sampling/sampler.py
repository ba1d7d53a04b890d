"""The batched `Sampler`: a batch of logits in, one token per row out.

The sampler turns a batch of logits into one token per row. Each row has its own parameters and,
when seeded, its own random generator (`seeded.py`: noise that is a function of the seed, the draw and
the token, made for all seeded rows at once), so a seeded request draws the same tokens whatever else
is in the batch. Order of operations, as in vLLM: penalties, then greedy rows take the argmax; the
others are divided by temperature, filtered by min-p, top-k and top-p, and sampled.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .params import SamplingParams
from .seeded import SeededGenerator, seeded_noise
from .token_counts import TokenCounts

# Per position: the chosen token's logprob first, then the top alternatives (token id -> logprob).
Logprobs = dict[int, float]


@dataclass
class SamplerOutput:
    """One sampled token per row; logprobs only when some row asked for them."""

    token_ids: torch.Tensor  # (B,) int64
    logprobs: torch.Tensor | None = None  # (B,) log-probability of each sampled token
    top_token_ids: torch.Tensor | None = None  # (B, K) the K most likely tokens, K = max requested
    top_logprobs: torch.Tensor | None = None  # (B, K)


def _token_counts(token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """(B, vocab) how often each token occurs in each row's list."""
    longest = max((len(ids) for ids in token_ids), default=0)
    # Pad with an extra id (vocab_size) that lands in a column we then drop.
    padded = torch.full((len(token_ids), longest), vocab_size, dtype=torch.int64)
    for row, ids in enumerate(token_ids):
        padded[row, : len(ids)] = torch.as_tensor(list(ids), dtype=torch.int64)
    counts = torch.zeros(len(token_ids), vocab_size + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(1, padded.to(device), torch.ones_like(padded, device=device))
    return counts[:, :vocab_size]  # (B, V)


def apply_penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    output_token_ids: Sequence[Sequence[int]] | None = None,
    prompt_token_ids: Sequence[Sequence[int]] | None = None,
    *,
    output_counts: torch.Tensor | None = None,
    prompt_seen: torch.Tensor | None = None,
) -> torch.Tensor:
    """Repetition (prompt and output tokens), frequency and presence (output tokens) penalties.

    Each row's tokens come either as lists (`output_token_ids`, `prompt_token_ids`) or already counted on
    the device (`output_counts` (B, V), `prompt_seen` (B, V) bool, as `TokenCounts` keeps them)."""
    batch, vocab = logits.shape
    device = logits.device
    if output_counts is None:
        output_counts = _token_counts(output_token_ids or [[]] * batch, vocab, device)  # (B, V)
    if prompt_seen is None:
        prompt_seen = _token_counts(prompt_token_ids or [[]] * batch, vocab, device) > 0  # (B, V)
    seen = (output_counts > 0) | prompt_seen  # (B, V)
    repetition = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
    frequency = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
    presence = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
    # Repetition penalty (CTRL paper): make seen tokens less likely whatever their logit's sign:
    # positive logits are divided by the penalty, negative ones multiplied by it.
    penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalised, logits)
    logits = logits - frequency * output_counts - presence * (output_counts > 0)
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p (B, 1) times the row's top probability."""
    probs = logits.softmax(dim=-1)
    threshold = min_p * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, -math.inf)


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep each row's top_k (B, 1) largest logits (ties at the boundary kept); top_k = vocab keeps all.

    `topk` finds the k-th largest without sorting the vocabulary: it selects the largest k (k = the
    largest top_k asked for in the batch), where a sort orders all of them."""
    return apply_top_k_top_p(logits, top_k, None)


def _top_p_remove(ascending: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """For logits sorted ascending (B, C): True where a token goes, keeping the smallest set of most
    likely tokens whose mass reaches top_p (B, 1), boundary token included."""
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)  # ascending: mass of this token and all smaller
    # A token goes when the tokens above it already hold top_p of the mass.
    remove = cumulative <= 1 - top_p
    remove[:, -1] = False  # the most likely token always stays
    return remove


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (B, 1), boundary token included."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool).scatter(1, order, _top_p_remove(sorted_logits, top_p))
    return logits.masked_fill(remove, -math.inf)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Top-k (B, 1) then top-p (B, 1); either may be None. Where every row has a top-k, top-p sorts only
    the candidates top-k kept (at most the largest top_k of the batch), not the whole vocabulary."""
    if top_k is None:
        return logits if top_p is None else apply_top_p(logits, top_p)
    limited = top_k < logits.shape[-1]  # (B, 1): rows with top_k = vocab keep everything
    if not bool(limited.any()):
        return logits if top_p is None else apply_top_p(logits, top_p)
    k_max = int(top_k[limited].max())
    values, ids = logits.topk(k_max, dim=-1)  # (B, k_max), descending
    kth_largest = values.gather(1, top_k.clamp(max=k_max) - 1).masked_fill(~limited, -math.inf)  # (B, 1)
    logits = logits.masked_fill(logits < kth_largest, -math.inf)
    if top_p is None:
        return logits
    kept = (logits > -math.inf).sum(dim=-1)  # (B,) ties at the boundary may keep more than top_k
    if not bool(limited.all()) or bool((kept > k_max).any()):
        return apply_top_p(logits, top_p)  # some candidates lie beyond the top k_max: sort them all
    candidates = values.masked_fill(torch.arange(k_max, device=logits.device) >= kept[:, None], -math.inf)
    remove_sorted = _top_p_remove(candidates.flip(-1), top_p).flip(-1)  # (B, k_max), descending order
    remove = torch.zeros_like(logits, dtype=torch.bool).scatter(1, ids, remove_sorted)
    return logits.masked_fill(remove, -math.inf)


def sampling_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution each non-greedy row samples from: logits (R, V), penalties already applied, divided
    by temperature, filtered by min-p, top-k and top-p, softmaxed: (R, V) float32. Speculative decoding's
    rejection sampler keeps drafts against these same distributions (`rejection.py`)."""
    device, vocab = logits.device, logits.shape[1]
    logits = logits.float() / torch.tensor([p.temperature for p in params], device=device)[:, None]
    if any(p.min_p > 0 for p in params):
        logits = apply_min_p(logits, torch.tensor([p.min_p for p in params], device=device)[:, None])
    top_k = top_p = None
    if any(0 < p.top_k < vocab for p in params):
        top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device)[:, None]
    if any(p.top_p < 1 for p in params):
        top_p = torch.tensor([p.top_p for p in params], device=device)[:, None]
    return apply_top_k_top_p(logits, top_k, top_p).softmax(dim=-1)


def penalized_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    output_token_ids: Sequence[Sequence[int]] | None = None,
    prompt_token_ids: Sequence[Sequence[int]] | None = None,
    blocked_token_ids: Sequence[Sequence[int]] | None = None,
    token_counts: Sequence[TokenCounts | None] | None = None,
) -> torch.Tensor:
    """The logits each row's rules leave, before temperature: blocked tokens (EOS before min_tokens) at -inf,
    then the penalties. Rows without either come back as they were (in float32 if any row changed)."""
    vocab = logits.shape[1]
    if blocked_token_ids is not None and any(blocked_token_ids):
        rows = [row for row, ids in enumerate(blocked_token_ids) for _ in ids]
        columns = [token for ids in blocked_token_ids for token in ids]
        index = (torch.tensor(rows, device=logits.device), torch.tensor(columns, device=logits.device))
        logits = logits.float().index_put(index, torch.tensor(-math.inf, device=logits.device))
    if any(p.has_penalties for p in params):
        if token_counts is not None and all(c is not None for c, p in zip(token_counts, params) if p.has_penalties):
            # rows without penalties get empty counts: with penalties of 1, 0 and 0 they change nothing
            empty = TokenCounts((), vocab, logits.device)
            counts = [c if c is not None else empty for c in token_counts]
            logits = apply_penalties(logits.float(), params,
                                     output_counts=torch.stack([c.output_counts for c in counts]),
                                     prompt_seen=torch.stack([c.prompt_seen for c in counts]))
        else:
            logits = apply_penalties(logits.float(), params, output_token_ids, prompt_token_ids)
    return logits


class Sampler:
    """Picks one token per row of a (B, vocab) logits batch, each row with its own SamplingParams.

    Invariant: a row whose request is seeded draws its randomness only from its own generator
    (`SeededGenerator`), so its tokens do not depend on the other rows. Unseeded rows share this
    sampler's `torch.Generator`.
    """

    def __init__(self, seed: int | None = None, device: torch.device | str = "cpu") -> None:
        self.generator = torch.Generator(device=device)
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[SeededGenerator | None] | None = None,
        output_token_ids: Sequence[Sequence[int]] | None = None,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        blocked_token_ids: Sequence[Sequence[int]] | None = None,
        token_counts: Sequence[TokenCounts | None] | None = None,
    ) -> SamplerOutput:
        """logits (B, vocab) -> SamplerOutput with token_ids (B,).

        Per row: the generator for seeded requests, the tokens generated so far and the prompt
        (for penalties), and tokens that must not be picked (EOS before `min_tokens`). Rows with
        penalties may bring their counts already on the device (`token_counts`, updated by the
        caller); the lists are then not read.
        """
        batch, vocab = logits.shape
        if len(params) != batch:
            raise ValueError(f"got {len(params)} SamplingParams for {batch} rows of logits")
        generators = generators if generators is not None else [None] * batch
        raw_logits = logits  # the model's dtype: a greedy batch needs no float32 copy of (B, vocab)
        logits = penalized_logits(logits, params, output_token_ids, prompt_token_ids, blocked_token_ids, token_counts)

        # Greedy rows keep this. `max` returns the first of equal maxima, as argmax does, and on the CPU
        # it is several times faster than argmax over a (B, vocab) batch in bfloat16.
        token_ids = logits.max(dim=-1).indices
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if random_rows:
            token_ids = self._sample_rows(logits, params, generators, random_rows, token_ids)

        output = SamplerOutput(token_ids=token_ids)
        num_top = max((p.logprobs for p in params if p.logprobs is not None), default=None)
        if num_top is not None:
            # As vLLM does by default, logprobs describe the model's raw distribution.
            logprobs = raw_logits.float().log_softmax(dim=-1)
            output.logprobs = logprobs.gather(1, token_ids[:, None]).squeeze(1)
            if num_top > 0:
                output.top_logprobs, output.top_token_ids = logprobs.topk(min(num_top, vocab), dim=-1)
        return output

    def _sample_rows(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[SeededGenerator | None],
        rows: list[int],
        token_ids: torch.Tensor,
    ) -> torch.Tensor:
        device, vocab = logits.device, logits.shape[1]
        row_index = torch.tensor(rows, device=device)
        probs = sampling_probs(logits[row_index], [params[i] for i in rows])  # (R, V)

        # Exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) draws token i with probability p_i,
        # and each row's noise can come from that row's own generator.
        noise = torch.empty_like(probs)
        seeded = [j for j, i in enumerate(rows) if generators[i] is not None]
        if not seeded:
            noise.exponential_(generator=self.generator)
        else:
            own = [generators[rows[j]] for j in seeded]
            if not all(isinstance(g, SeededGenerator) for g in own):
                raise TypeError("a seeded row's generator must be a SeededGenerator (SamplingParams.make_generator)")
            noise[torch.tensor(seeded, device=device)] = seeded_noise(own, vocab, device)  # every seeded row at once
            unseeded = [j for j in range(len(rows)) if generators[rows[j]] is None]
            if unseeded:
                shared = torch.empty(len(unseeded), vocab, device=device).exponential_(generator=self.generator)
                noise[torch.tensor(unseeded, device=device)] = shared
        # A zero draw would turn a filtered-out token's 0 / 0 into NaN, which argmax would pick.
        sampled = (probs / noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)
        return token_ids.index_copy(0, row_index, sampled)
