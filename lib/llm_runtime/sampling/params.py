"""`SamplingParams`: how to pick tokens for one request (vLLM's fields and defaults), validated in one place."""

from __future__ import annotations

import math
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
