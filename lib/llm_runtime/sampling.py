"""Sampling: `SamplingParams` (vLLM's fields and defaults, validated in one place) and the batched `Sampler`.

The sampler turns a batch of logits into one token per row. Each row has its own parameters and,
when seeded, its own random generator, so a seeded request draws the same tokens whatever else is
in the batch. Order of operations, as in vLLM: penalties, then greedy rows take the argmax; the
others are divided by temperature, filtered by min-p, top-k and top-p, and sampled.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Temperatures below this are greedy (dividing by ~0 would overflow).
GREEDY_TEMPERATURE = 1e-5


def _check_number(
    name: str,
    value: object,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    integer: bool = False,
    allowed: str,
) -> None:
    """Raise ValueError naming the field and its allowed range unless `value` is a finite number in range."""
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ValueError(f"{name} must be {'an integer' if integer else 'a number'} {allowed}, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number {allowed}, got {value!r}")
    too_low = low is not None and (value <= low if low_open else value < low)
    if too_low or (high is not None and value > high):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request; field names and defaults follow vLLM's SamplingParams."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k filter
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: until the model's context is full
    min_tokens: int = 0
    logprobs: int | None = None  # number of top logprobs to return besides the sampled token's
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        _check_number("n", self.n, low=1, integer=True, allowed=">= 1")
        for name in ("presence_penalty", "frequency_penalty"):
            _check_number(name, getattr(self, name), low=-2.0, high=2.0, allowed="in [-2, 2]")
        _check_number("repetition_penalty", self.repetition_penalty, low=0.0, low_open=True, allowed="> 0")
        _check_number("temperature", self.temperature, low=0.0, allowed=">= 0")
        _check_number("top_p", self.top_p, low=0.0, high=1.0, low_open=True, allowed="in (0, 1]")
        _check_number("top_k", self.top_k, low=-1, integer=True, allowed="-1, 0 (disabled) or >= 1")
        _check_number("min_p", self.min_p, low=0.0, high=1.0, allowed="in [0, 1]")
        if self.seed is not None:
            _check_number("seed", self.seed, integer=True, allowed="(or None)")
        if self.max_tokens is not None:
            _check_number("max_tokens", self.max_tokens, low=1, integer=True, allowed=">= 1 (or None)")
        _check_number("min_tokens", self.min_tokens, low=0, integer=True, allowed=">= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.logprobs is not None:
            _check_number("logprobs", self.logprobs, low=0, integer=True, allowed=">= 0 (or None)")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        # Normalise stop and stop_token_ids to lists (frozen: set through object.__setattr__).
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if stop is not None and not (isinstance(stop, (list, tuple)) and all(isinstance(s, str) and s for s in stop)):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        object.__setattr__(self, "stop", list(stop or []))
        ids = self.stop_token_ids
        if ids is not None and not (isinstance(ids, (list, tuple)) and all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)):
            raise ValueError(f"stop_token_ids must be a list of integers >= 0, got {ids!r}")
        object.__setattr__(self, "stop_token_ids", list(ids or []))

    @property
    def is_greedy(self) -> bool:
        """Temperature 0 (or below 1e-5) means: take the most likely token."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def make_generator(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        """A fresh generator seeded with `seed`, or None when the request is unseeded."""
        if self.seed is None:
            return None
        return torch.Generator(device=device).manual_seed(self.seed)


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
    output_token_ids: Sequence[Sequence[int]],
    prompt_token_ids: Sequence[Sequence[int]],
) -> torch.Tensor:
    """Repetition (prompt and output tokens), frequency and presence (output tokens) penalties."""
    batch, vocab = logits.shape
    device = logits.device
    output_counts = _token_counts(output_token_ids, vocab, device)  # (B, V)
    seen = (output_counts + _token_counts(prompt_token_ids, vocab, device)) > 0  # (B, V)
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
    """Keep each row's top_k (B, 1) largest logits (ties at the boundary kept); top_k = vocab keeps all."""
    sorted_logits = logits.sort(dim=-1, descending=True).values
    kth_largest = sorted_logits.gather(1, top_k - 1)  # (B, 1)
    return logits.masked_fill(logits < kth_largest, -math.inf)


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (B, 1), boundary token included."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # ascending: mass of this token and all smaller
    # A token goes when the tokens above it already hold top_p of the mass.
    remove_sorted = cumulative <= 1 - top_p
    remove_sorted[:, -1] = False  # the most likely token always stays
    remove = torch.zeros_like(remove_sorted).scatter(1, order, remove_sorted)
    return logits.masked_fill(remove, -math.inf)


class Sampler:
    """Picks one token per row of a (B, vocab) logits batch, each row with its own SamplingParams.

    Invariant: a row whose request is seeded draws its randomness only from its own generator,
    so its tokens do not depend on the other rows. Unseeded rows share this sampler's generator.
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
        generators: Sequence[torch.Generator | None] | None = None,
        output_token_ids: Sequence[Sequence[int]] | None = None,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        blocked_token_ids: Sequence[Sequence[int]] | None = None,
    ) -> SamplerOutput:
        """logits (B, vocab) -> SamplerOutput with token_ids (B,).

        Per row: the generator for seeded requests, the tokens generated so far and the prompt
        (for penalties), and tokens that must not be picked (EOS before `min_tokens`).
        """
        batch, vocab = logits.shape
        if len(params) != batch:
            raise ValueError(f"got {len(params)} SamplingParams for {batch} rows of logits")
        generators = generators if generators is not None else [None] * batch
        raw_logits = logits.float()
        logits = raw_logits
        if blocked_token_ids is not None and any(blocked_token_ids):
            rows = [row for row, ids in enumerate(blocked_token_ids) for _ in ids]
            columns = [token for ids in blocked_token_ids for token in ids]
            index = (torch.tensor(rows, device=logits.device), torch.tensor(columns, device=logits.device))
            logits = logits.index_put(index, torch.tensor(-math.inf, device=logits.device))
        if any(p.has_penalties for p in params):
            logits = apply_penalties(
                logits, params, output_token_ids or [[]] * batch, prompt_token_ids or [[]] * batch
            )

        token_ids = logits.argmax(dim=-1)  # greedy rows keep this
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if random_rows:
            token_ids = self._sample_rows(logits, params, generators, random_rows, token_ids)

        output = SamplerOutput(token_ids=token_ids)
        num_top = max((p.logprobs for p in params if p.logprobs is not None), default=None)
        if num_top is not None:
            # As vLLM does by default, logprobs describe the model's raw distribution.
            logprobs = raw_logits.log_softmax(dim=-1)
            output.logprobs = logprobs.gather(1, token_ids[:, None]).squeeze(1)
            if num_top > 0:
                output.top_logprobs, output.top_token_ids = logprobs.topk(min(num_top, vocab), dim=-1)
        return output

    def _sample_rows(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        rows: list[int],
        token_ids: torch.Tensor,
    ) -> torch.Tensor:
        device, vocab = logits.device, logits.shape[1]
        row_index = torch.tensor(rows, device=device)
        chosen = [params[i] for i in rows]
        logits = logits[row_index]  # (R, V)
        temperature = torch.tensor([p.temperature for p in chosen], device=device)[:, None]
        logits = logits / temperature
        if any(p.min_p > 0 for p in chosen):
            logits = apply_min_p(logits, torch.tensor([p.min_p for p in chosen], device=device)[:, None])
        if any(0 < p.top_k < vocab for p in chosen):
            top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in chosen]
            logits = apply_top_k(logits, torch.tensor(top_k, device=device)[:, None])
        if any(p.top_p < 1 for p in chosen):
            logits = apply_top_p(logits, torch.tensor([p.top_p for p in chosen], device=device)[:, None])
        probs = logits.softmax(dim=-1)  # (R, V)

        # Exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) draws token i with probability p_i,
        # and each row's noise can come from that row's own generator.
        noise = torch.empty_like(probs)
        unseeded = [j for j, i in enumerate(rows) if generators[i] is None]
        if len(unseeded) == len(rows):
            noise.exponential_(generator=self.generator)
        elif unseeded:
            shared = torch.empty(len(unseeded), vocab, device=device).exponential_(generator=self.generator)
            noise[torch.tensor(unseeded, device=device)] = shared
        for j, i in enumerate(rows):
            generator = generators[i]
            if generator is not None:
                noise[j].exponential_(generator=generator)
        # A zero draw would turn a filtered-out token's 0 / 0 into NaN, which argmax would pick.
        sampled = (probs / noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)
        return token_ids.index_copy(0, row_index, sampled)
