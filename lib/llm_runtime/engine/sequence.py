"""A request's state: its tokens, its status, why it finished, and when each thing happened.

A sequence moves WAITING -> RUNNING -> FINISHED_* (stopped, length or aborted); the scheduler may
move it back to WAITING when it runs out of KV memory (preemption: its tokens are kept, its cache is
recomputed when it runs again). The stop rules live here, applied to each
new token in `append_token`: EOS unless `ignore_eos`, `stop_token_ids`, `stop` strings matched
across token boundaries (and cut from the text, as vLLM does), `max_tokens`; none of the first
three before `min_tokens` tokens exist.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from ..attention.kv_cache import ContiguousKVCache
from ..sampling import Sampler, SamplerOutput, SamplingParams
from .detokenizer import IncrementalDetokenizer


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        """vLLM's names: "stop" (EOS, stop token or string), "length" (max_tokens or context), "abort"."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}


@dataclass
class SequenceTimes:
    """Wall-clock timestamps (time.perf_counter seconds) of a request's life."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished: float | None = None


class Sequence:
    """One generated completion: prompt, output so far, status, KV cache and timestamps.

    Invariant: `num_computed_tokens` tokens (a prefix of prompt + output) have their keys and
    values in a cache: the engine's paged pool (found through the sequence's block table), or
    `kv_cache` when a lesson drives the sequence by hand. The model runner computes the rest.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        max_new_tokens: int,
        eos_token_ids: tuple[int, ...] = (),
        detokenizer: IncrementalDetokenizer | None = None,
        index: int = 0,
        arrival_time: float | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        self.request_id = request_id
        self.index = index  # which of the request's n completions this is
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids: list[int] = []
        self.params = params
        self.max_new_tokens = max_new_tokens
        self.eos_token_ids = () if params.ignore_eos else tuple(eos_token_ids)
        self.stop_token_ids = tuple(params.stop_token_ids)
        self.detokenizer = detokenizer
        self.generator = generator
        self.status = SequenceStatus.WAITING
        self.stop_reason: int | str | None = None  # the stop token id or string that ended it
        self.num_computed_tokens = 0
        self.kv_cache: ContiguousKVCache | None = None
        self.output_text = ""
        self.num_streamed_chars = 0
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.times = SequenceTimes(arrival=time.perf_counter() if arrival_time is None else arrival_time)
        self._max_stop_len = max((len(s) for s in params.stop), default=0)

    # ------------------------------------------------------------------ sizes
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens not yet in the KV cache: the rest of the prompt while prefilling, then 1 per decode."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output."""
        prompt = self.prompt_token_ids
        if end <= len(prompt):
            return prompt[start:end]
        if start >= len(prompt):  # decode: only output tokens, no copy of the prompt
            return self.output_token_ids[start - len(prompt) : end - len(prompt)]
        return (prompt + self.output_token_ids)[start:end]

    def blocked_token_ids(self) -> tuple[int, ...]:
        """Tokens the sampler must not pick now: EOS and stop tokens, until min_tokens are out."""
        if self.num_output_tokens < self.params.min_tokens:
            return self.eos_token_ids + self.stop_token_ids
        return ()

    # ------------------------------------------------------------------ transitions
    def append_token(self, token_id: int, now: float, logprobs: dict[int, float] | None = None) -> None:
        """Record a sampled token, extend the text, and finish the sequence if a stop rule fires."""
        if self.is_finished:
            raise RuntimeError(f"sequence {self.request_id}/{self.index} is finished; cannot append")
        self.output_token_ids.append(token_id)
        if self.logprobs is not None and logprobs is not None:
            self.logprobs.append(logprobs)
        if self.times.first_token is None:
            self.times.first_token = now
        self.times.token_times.append(now)
        text_before = len(self.output_text)
        if self.detokenizer is not None:
            self.output_text += self.detokenizer.add(token_id)
        self._check_stop(token_id, text_before, now)

    def _check_stop(self, token_id: int, text_before: int, now: float) -> None:
        may_stop = self.num_output_tokens >= self.params.min_tokens
        if may_stop and (token_id in self.eos_token_ids or token_id in self.stop_token_ids):
            if token_id not in self.eos_token_ids:
                self.stop_reason = token_id
            if not self.params.include_stop_str_in_output:
                # As vLLM does, the stopping token's own text is not part of the output.
                self.output_text = self.output_text[:text_before]
            self.finish(SequenceStatus.FINISHED_STOPPED, now, flush=self.params.include_stop_str_in_output)
        elif may_stop and self._max_stop_len and self._find_stop_string(text_before):
            self.finish(SequenceStatus.FINISHED_STOPPED, now, flush=False)
        elif self.num_output_tokens >= self.max_new_tokens:
            self.finish(SequenceStatus.FINISHED_LENGTH, now)

    def _find_stop_string(self, text_before: int) -> bool:
        """Look for a stop string that ends in the new text; cut the text there if found."""
        start = max(0, text_before - self._max_stop_len + 1)  # a match may begin in earlier text
        matches = [(self.output_text.find(s, start), s) for s in self.params.stop]
        matches = [(i, s) for i, s in matches if i >= 0]
        if not matches:
            return False
        position, stop = min(matches)
        end = position + len(stop) if self.params.include_stop_str_in_output else position
        self.output_text = self.output_text[:end]
        self.stop_reason = stop
        return True

    def finish(self, status: SequenceStatus, now: float, flush: bool = True) -> None:
        """Move to a finished status; release the rest of the text and the KV cache."""
        if not status.is_finished:
            raise ValueError(f"{status} is not a finished status")
        if flush and self.detokenizer is not None:
            self.output_text += self.detokenizer.flush()
        self.status = status
        self.times.finished = now
        self.kv_cache = None

    # ------------------------------------------------------------------ streaming
    def take_text_delta(self) -> str:
        """Text produced since the last call; while running, hold back what could start a stop string."""
        end = len(self.output_text)
        if not self.is_finished and self._max_stop_len:
            end -= self._max_stop_len - 1
        if end <= self.num_streamed_chars:
            return ""
        delta = self.output_text[self.num_streamed_chars : end]
        self.num_streamed_chars = end
        return delta

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, index={self.index}, {self.status.name}, "
                f"prompt={self.num_prompt_tokens}, output={self.num_output_tokens}, "
                f"computed={self.num_computed_tokens})")


def sample_sequences(sampler: Sampler, logits: torch.Tensor, sequences: list[Sequence]) -> SamplerOutput:
    """Sample one token per row of logits (R, vocab), row i for sequences[i], with its own state."""
    return sampler(
        logits,
        [seq.params for seq in sequences],
        [seq.generator for seq in sequences],
        [seq.output_token_ids for seq in sequences],
        [seq.prompt_token_ids for seq in sequences],
        [seq.blocked_token_ids() for seq in sequences],
    )
