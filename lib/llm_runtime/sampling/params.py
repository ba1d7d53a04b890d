"""`SamplingParams`: how to pick tokens for one request (vLLM's fields and defaults), validated in one place.

`FIELD_BOUNDS` is the one statement of every numeric field's range: `SamplingParams` checks it, and
the HTTP server writes the same bounds into its OpenAPI schema. Limits that depend on the engine
(the vocabulary, the context, `max_logprobs`, `max_num_seqs`) are checked by the input processor.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace

from ..errors import InvalidRequestError
from .seeded import SeededGenerator
from .structured_outputs import StructuredOutputsParams

# Temperatures below this are greedy (dividing by ~0 would overflow).
GREEDY_TEMPERATURE = 1e-5
# Seeds are 64-bit signed integers, as in vLLM's API (the seeded generator hashes all 64 bits).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


def sibling_seed(seed: int, index: int) -> int:
    """seed + index in the ring of 64-bit signed integers: what completion `index` of a seeded request uses."""
    return (seed + index - SEED_MIN) % 2**64 + SEED_MIN


class RequestOutputKind(enum.Enum):
    """What each `RequestOutput` of a request carries, as in vLLM.

    CUMULATIVE: everything so far (copies the whole completion every step; the default).
    DELTA: only what is new since the previous output (constant work per token; for streams).
    FINAL_ONLY: one output, when the request finishes (for `LLM.generate`, non-streaming HTTP).
    """

    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


@dataclass(frozen=True)
class Bounds:
    """The allowed range of one numeric field: [low, high], or (low, high] with `low_open`."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    integer: bool = False

    def describe(self) -> str:
        if self.low is not None and self.high is not None:
            return f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}]"
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        return f"<= {self.high:g}" if self.high is not None else "any value"

    def check(self, name: str, value: object, extra: str = "") -> None:
        """Raise InvalidRequestError naming `name` unless `value` is a finite number in range."""
        allowed = self.describe() + extra
        if isinstance(value, bool) or not isinstance(value, int if self.integer else (int, float)):
            raise InvalidRequestError(
                name, f"{name} must be {'an integer' if self.integer else 'a number'} {allowed}, got {value!r}")
        if not math.isfinite(value):
            raise InvalidRequestError(name, f"{name} must be a finite number {allowed}, got {value!r}")
        too_low = self.low is not None and (value <= self.low if self.low_open else value < self.low)
        if too_low or (self.high is not None and value > self.high):
            raise InvalidRequestError(name, f"{name} must be {allowed}, got {value!r}")


FIELD_BOUNDS: dict[str, Bounds] = {
    "n": Bounds(low=1, integer=True),
    "presence_penalty": Bounds(low=-2.0, high=2.0),
    "frequency_penalty": Bounds(low=-2.0, high=2.0),
    "repetition_penalty": Bounds(low=0.0, low_open=True),
    "temperature": Bounds(low=0.0),
    "top_p": Bounds(low=0.0, high=1.0, low_open=True),
    "top_k": Bounds(low=-1, integer=True),  # -1 or 0: no top-k filter
    "min_p": Bounds(low=0.0, high=1.0),
    "seed": Bounds(low=SEED_MIN, high=SEED_MAX, integer=True),
    "max_tokens": Bounds(low=1, integer=True),
    "min_tokens": Bounds(low=0, integer=True),
    "logprobs": Bounds(low=0, integer=True),
    "prompt_logprobs": Bounds(low=0, integer=True),
}
_OPTIONAL = ("seed", "max_tokens", "logprobs", "prompt_logprobs")  # None is allowed too


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
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # A grammar the output must follow (lesson 15): a JSON schema, a regex, a choice, an EBNF grammar.
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        for name, bounds in FIELD_BOUNDS.items():
            value = getattr(self, name)
            if value is not None or name not in _OPTIONAL:
                bounds.check(name, value, " (or None)" if name in _OPTIONAL else "")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                "min_tokens", f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(name, f"{name} must be True or False, got {getattr(self, name)!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise InvalidRequestError("output_kind", f"output_kind must be a RequestOutputKind, got "
                                                     f"{self.output_kind!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise InvalidRequestError("structured_outputs", f"structured_outputs must be a StructuredOutputsParams, "
                                                            f"got {type(self.structured_outputs).__name__}")
        # Normalise stop and stop_token_ids to lists (frozen: set through object.__setattr__).
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if stop is not None and not (isinstance(stop, (list, tuple)) and all(isinstance(s, str) and s for s in stop)):
            raise InvalidRequestError("stop", f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        object.__setattr__(self, "stop", list(stop or []))
        ids = self.stop_token_ids
        if ids is not None and not (isinstance(ids, (list, tuple)) and all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)):
            raise InvalidRequestError("stop_token_ids", f"stop_token_ids must be a list of integers >= 0, got {ids!r}")
        object.__setattr__(self, "stop_token_ids", list(ids or []))

    @property
    def is_greedy(self) -> bool:
        """Temperature 0 (or below 1e-5) means: take the most likely token."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def for_completion(self, index: int) -> "SamplingParams":
        """The parameters of completion `index` of an n > 1 request: these, with seed + index when seeded (as
        vLLM does), wrapped around within the 64-bit seed range, so that no seed a request may give makes a
        sibling's parameters invalid (seed 2**63 - 1 and n = 2 give the second completion seed -2**63)."""
        if self.seed is None or index == 0:
            return self
        return replace(self, seed=sibling_seed(self.seed, index))

    def make_generator(self) -> SeededGenerator | None:
        """A fresh generator seeded with `seed` (its noise is made on the logits' device), or None when the
        request is unseeded."""
        if self.seed is None:
            return None
        return SeededGenerator(self.seed)
