"""A request's state: its tokens, its status, why it finished, and when each thing happened.

A sequence moves WAITING -> RUNNING -> FINISHED_* (stopped, length, aborted or error); the
scheduler may move it back to WAITING when it runs out of KV memory (preemption: its tokens are
kept, its cache is recomputed when it runs again). The token stop rules live here, applied to each
new token in `append_token`: EOS unless `ignore_eos`, `stop_token_ids`, `max_tokens`; none of the
first two before `min_tokens` tokens exist. Stop *strings* need the text, which the output
processor keeps (`output_processor.py`), as in vLLM. A constrained sequence's grammar (lesson 15) follows
every appended token; once the grammar is complete and has taken its end, the sequence stops.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field

import torch

from ..sampling import Sampler, SamplerOutput, SamplingParams
from ..sampling.rejection import RejectionSampler, VerifiedDrafts
from ..sampling.seeded import SeededGenerator
from ..sampling.token_counts import TokenCounts
from ..structured_output import GrammarState

logger = logging.getLogger(__name__)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        """vLLM's names: "stop" (EOS, stop token or string), "length" (max_tokens or context), "abort",
        "error" (a step failed for this request; the engine went on with the others)."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_ERROR: "error",
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
    """One generated completion: prompt, output so far, status and timestamps.

    Invariant: `num_computed_tokens` tokens (a prefix of prompt + output) have their keys and
    values in a cache (the engine's paged pool, found through the sequence's block table); the
    model runner computes the rest.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        max_new_tokens: int,
        eos_token_ids: tuple[int, ...] = (),
        index: int = 0,
        arrival_time: float | None = None,
        generator: SeededGenerator | None = None,
        grammar: GrammarState | None = None,
    ) -> None:
        self.request_id = request_id
        self.index = index  # which of the request's n completions this is
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids: list[int] = []
        self.params = params
        self.max_new_tokens = max_new_tokens
        self.eos_token_ids = () if params.ignore_eos else tuple(eos_token_ids)
        self.stop_token_ids = tuple(params.stop_token_ids)
        self.generator = generator
        self.grammar = grammar  # where its output stands in its structured_outputs grammar (lesson 15)
        self._token_counts: TokenCounts | None = None  # penalties' counts on the device, made when first needed
        self.status = SequenceStatus.WAITING
        self.stop_reason: int | str | None = None  # the stop token id or string that ended it
        self.num_computed_tokens = 0
        # Speculative decoding (lesson 14): the tokens a proposer guesses come next, set before a step
        # schedules it and cleared after; with a draft model's distributions (k, vocab) for a sampled request.
        self.draft_token_ids: list[int] = []
        self.draft_probs: torch.Tensor | None = None
        self.times = SequenceTimes(arrival=time.perf_counter() if arrival_time is None else arrival_time)

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

    def token_counts(self, vocab_size: int, device: torch.device) -> TokenCounts:
        """This sequence's prompt mask and output counts on `device`, brought up to date (penalties)."""
        if self._token_counts is None:
            self._token_counts = TokenCounts(self.prompt_token_ids, vocab_size, device)
        return self._token_counts.update(self.output_token_ids)

    def blocked_token_ids(self) -> tuple[int, ...]:
        """Tokens the sampler must not pick now: EOS and stop tokens, until min_tokens are out."""
        if self.num_output_tokens < self.params.min_tokens:
            return self.eos_token_ids + self.stop_token_ids
        return ()

    # ------------------------------------------------------------------ transitions
    def append_token(self, token_id: int, now: float) -> None:
        """Record a sampled token and finish the sequence if a token stop rule fires."""
        if self.is_finished:
            raise RuntimeError(f"sequence {self.request_id}/{self.index} is finished; cannot append")
        self.output_token_ids.append(token_id)
        if self.times.first_token is None:
            self.times.first_token = now
        self.times.token_times.append(now)
        if self.grammar is not None and not self.grammar.accept(token_id):  # only a bug gets a refused token here
            logger.error("%r: token %d is not allowed by its grammar; finishing it with an error", self, token_id)
            self.finish(SequenceStatus.FINISHED_ERROR, now)
            return
        may_stop = self.num_output_tokens >= self.params.min_tokens
        if may_stop and (token_id in self.eos_token_ids or token_id in self.stop_token_ids):
            if token_id not in self.eos_token_ids:
                self.stop_reason = token_id
            self.finish(SequenceStatus.FINISHED_STOPPED, now)
        elif self.grammar is not None and self.grammar.is_terminated:  # complete, its end taken (ignore_eos too)
            self.finish(SequenceStatus.FINISHED_STOPPED, now)
        elif self.num_output_tokens >= self.max_new_tokens:
            self.finish(SequenceStatus.FINISHED_LENGTH, now)

    def truncate_output(self, num_tokens: int) -> None:
        """Keep the first `num_tokens` output tokens of a finished sequence (a stop string ended it there, before
        drafts its step had kept)."""
        if not self.is_finished:
            raise RuntimeError(f"sequence {self.request_id}/{self.index} is running; only a finished one is cut")
        del self.output_token_ids[num_tokens:]
        del self.times.token_times[num_tokens:]

    def finish(self, status: SequenceStatus, now: float, stop_reason: int | str | None = None) -> None:
        """Move to a finished status (a stop string found after the length limit still wins, as in vLLM)."""
        if not status.is_finished:
            raise ValueError(f"{status} is not a finished status")
        self.status = status
        if stop_reason is not None:
            self.stop_reason = stop_reason
        self.times.finished = now

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, index={self.index}, {self.status.name}, "
                f"prompt={self.num_prompt_tokens}, output={self.num_output_tokens}, "
                f"computed={self.num_computed_tokens})")


def sample_sequences(sampler: Sampler, logits: torch.Tensor, sequences: list[Sequence]) -> SamplerOutput:
    """Sample one token per row of logits (R, vocab), row i for sequences[i], with its own state."""
    for seq in sequences:
        if seq.generator is not None:  # draw k is output token k: a retried or recomputed step draws the same
            seq.generator.draws = seq.num_output_tokens
    return sampler(
        logits,
        [seq.params for seq in sequences],
        [seq.generator for seq in sequences],
        [seq.output_token_ids for seq in sequences],
        [seq.prompt_token_ids for seq in sequences],
        [seq.blocked_token_ids() for seq in sequences],
        [seq.token_counts(logits.shape[1], logits.device) if seq.params.has_penalties else None for seq in sequences],
    )


def verify_drafts(rejection_sampler: RejectionSampler, logits: torch.Tensor, items: list) -> VerifiedDrafts:
    """Verify the drafts of scheduled speculating sequences (`ScheduledSequence`s, each with k drafts and
    k + 1 rows of logits (sum of k + 1, vocab), in order): the drafts each keeps and the token after them."""
    seqs = [item.seq for item in items]
    return rejection_sampler(
        logits,
        [item.draft_token_ids for item in items],
        [None if item.seq.draft_probs is None else item.seq.draft_probs[: len(item.draft_token_ids)] for item in items],
        [seq.params for seq in seqs],
        [seq.generator for seq in seqs],
        [seq.output_token_ids for seq in seqs],
        [seq.prompt_token_ids for seq in seqs],
        [seq.blocked_token_ids() for seq in seqs],
    )
