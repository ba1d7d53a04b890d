"""The scheduler: which sequences run in the next step, and how many tokens each.

Iteration-level (continuous) scheduling, first come first served. Every step:
1. every running sequence gets its next tokens: one for a decode, the rest of its prompt (or as
   much as the token budget allows) for a prefill that was split;
2. waiting sequences are admitted in arrival order while there is room: fewer than `max_num_seqs`
   running and tokens left in `max_num_batched_tokens`. A prompt larger than what is left is
   split (chunked prefill) and continues next step.
After the step, `postprocess` appends the sampled tokens; finished sequences leave at once and
their slots go to waiting ones at the very next step. Data flows one way: schedule -> run -> postprocess.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from .config import EngineConfig
from .sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSequence:
    """One sequence's share of a step: tokens [start, start + num_new_tokens) of prompt + output."""

    seq: Sequence
    start: int
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this step produces a token for it (false for a prefill chunk short of the end)."""
        return self.start + self.num_new_tokens == self.seq.num_tokens

    @property
    def is_prefill(self) -> bool:
        return self.start < self.seq.num_prompt_tokens


@dataclass
class ScheduledBatch:
    """The work of one step: a ragged batch of prefill chunks and decode tokens."""

    items: list[ScheduledSequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(item.num_new_tokens for item in self.items)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(item.num_new_tokens for item in self.items if item.is_prefill)

    @property
    def num_decode_tokens(self) -> int:
        return self.num_tokens - self.num_prefill_tokens

    def __len__(self) -> int:
        return len(self.items)


@dataclass
class StepRecord:
    """What one step did: which sequences ran, how many tokens each, and how long it took."""

    index: int
    start: float
    duration: float
    # (request_id, completion index, tokens this step, whether a prefill chunk)
    items: list[tuple[str, int, int, bool]] = field(default_factory=list)


class Scheduler:
    """FCFS continuous batching under a sequence cap and a per-step token budget.

    Invariants: a sequence is in exactly one of `waiting` (not started) and `running` (in flight)
    until it finishes; `running` never holds more than `max_num_seqs`; a step never holds more than
    `max_num_batched_tokens` tokens.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        """Pick this step's sequences and token counts; admitted sequences become RUNNING."""
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        for seq in self.running:  # running first: decodes are never starved by new prompts
            if budget == 0:
                break
            num_new = min(seq.num_uncomputed_tokens, budget)
            batch.items.append(ScheduledSequence(seq, seq.num_computed_tokens, num_new))
            budget -= num_new
        now = time.perf_counter()
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            num_new = min(seq.num_uncomputed_tokens, budget)
            if num_new < seq.num_uncomputed_tokens and not self.config.enable_chunked_prefill:
                break  # the whole prompt must fit in one step; wait for a step with room
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            if seq.times.first_scheduled is None:
                seq.times.first_scheduled = now
            self.running.append(seq)
            batch.items.append(ScheduledSequence(seq, seq.num_computed_tokens, num_new))
            budget -= num_new
        return batch

    def postprocess(
        self,
        batch: ScheduledBatch,
        sampled: list[int | None],
        now: float,
        logprobs: list[dict[int, float] | None] | None = None,
    ) -> list[Sequence]:
        """Record the step's results; return the sequences that finished in it (already removed)."""
        finished = []
        for i, (item, token) in enumerate(zip(batch.items, sampled)):
            seq = item.seq
            if seq.is_finished:  # aborted while the step ran
                continue
            seq.num_computed_tokens += item.num_new_tokens
            if token is not None:
                seq.append_token(token, now, logprobs[i] if logprobs is not None else None)
            if seq.is_finished:
                finished.append(seq)
        if finished:
            self.running = [seq for seq in self.running if not seq.is_finished]
        return finished

    def abort(self, request_id: str) -> list[Sequence]:
        """Finish every sequence of `request_id` as aborted; return them."""
        now = time.perf_counter()
        aborted = [seq for seq in (*self.waiting, *self.running) if seq.request_id == request_id]
        for seq in aborted:
            seq.finish(SequenceStatus.FINISHED_ABORTED, now)
        self.waiting = deque(seq for seq in self.waiting if seq.request_id != request_id)
        self.running = [seq for seq in self.running if seq.request_id != request_id]
        return aborted
