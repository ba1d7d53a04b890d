"""`SpeculativeConfig`: which proposer guesses, and how far (vLLM's `speculative_config`, lesson 14).

Given as vLLM takes it, a dict on `LLM(speculative_config=...)`, `LLMEngine` and `--speculative-config
JSON` on `serve` and `bench`:

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    {"method": "draft", "model": "<folder or hub id>", "num_speculative_tokens": 3}
    {"method": "draft", "model": "self", "quantization": "gguf", "num_speculative_tokens": 3}

`"model": "self"` drafts with the target's own weights loaded again, quantized by `quantization` (on the
CPU, the bundled model's own 4-bit copy: the same tokenizer, a fraction of the bytes per step).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None  # ngram: the longest suffix matched
    prompt_lookup_min: int | None = None  # ngram: the shortest
    model: str | None = None  # draft: a folder, a hub id, or "self"
    quantization: str | None = None  # draft: how the draft model's weights are loaded (lesson 13)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be an integer in 1..{MAX_SPECULATIVE_TOKENS}, "
                             f"got {self.num_speculative_tokens!r}")
        if self.method == "ngram":
            if self.model is not None or self.quantization is not None:
                raise ValueError("an ngram proposer takes no model or quantization")
            lookup_max = 4 if self.prompt_lookup_max is None else self.prompt_lookup_max
            lookup_min = 1 if self.prompt_lookup_min is None else self.prompt_lookup_min
            if not (isinstance(lookup_max, int) and isinstance(lookup_min, int) and 1 <= lookup_min <= lookup_max):
                raise ValueError(f"need integers 1 <= prompt_lookup_min <= prompt_lookup_max, "
                                 f"got {lookup_min!r} and {lookup_max!r}")
            object.__setattr__(self, "prompt_lookup_max", lookup_max)
            object.__setattr__(self, "prompt_lookup_min", lookup_min)
        else:
            if not self.model:
                raise ValueError('a draft proposer needs "model": a folder, a hub id, or "self"')
            if self.prompt_lookup_max is not None or self.prompt_lookup_min is not None:
                raise ValueError("prompt_lookup_max and prompt_lookup_min are for the ngram method")

    @classmethod
    def parse(cls, value: "SpeculativeConfig | Mapping[str, Any] | None") -> "SpeculativeConfig | None":
        """A config from vLLM's dict form (unknown keys refused by name), or None for no speculation."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, Mapping):
            raise TypeError(f"speculative_config must be a dict, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        if "method" not in value or "num_speculative_tokens" not in value:
            raise ValueError('speculative_config needs "method" and "num_speculative_tokens"')
        return cls(**value)
