"""What the engine returns: `RequestOutput` and `CompletionOutput`, shaped like vLLM's."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..core.sequence import Sequence

# Per position: the chosen token's logprob first, then the top alternatives (token id -> logprob).
Logprobs = dict[int, float]


@dataclass
class RequestMetrics:
    """A request's timestamps (time.perf_counter seconds), as in vLLM's RequestMetrics.

    `token_times` (every token's arrival) is filled in a request's final output only.
    """

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float | None
    token_times: list[float] = field(default_factory=list)

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def time_in_queue(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        """End to end: arrival to the last token."""
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class CompletionOutput:
    """One of a request's n completions.

    With `RequestOutputKind.DELTA`, `text`, `token_ids` and `logprobs` hold only what is new since
    the previous output; otherwise everything so far. `text_delta` and `token_ids_delta` are always
    the new part (what a stream sends).
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", "error" or None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[Logprobs] | None = None  # per token: its logprob, then the top alternatives
    text_delta: str = ""
    token_ids_delta: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request after a step (or at the end): prompt, completions, metrics."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # With SamplingParams.prompt_logprobs: per prompt token (None for the first, which has no context).
    prompt_logprobs: list[Logprobs | None] | None = None


def request_metrics(sequences: list[Sequence], with_token_times: bool) -> RequestMetrics:
    """One request's metrics from its sequences (n > 1: first token of any, finish of the last)."""
    times = [seq.times for seq in sequences]
    first_tokens = [t.first_token for t in times if t.first_token is not None]
    scheduled = [t.first_scheduled for t in times if t.first_scheduled is not None]
    last_tokens = [t.token_times[-1] for t in times if t.token_times]
    finished = [t.finished for t in times]
    return RequestMetrics(
        arrival_time=times[0].arrival,
        first_scheduled_time=min(scheduled, default=None),
        first_token_time=min(first_tokens, default=None),
        last_token_time=max(last_tokens, default=None),
        finished_time=None if any(f is None for f in finished) else max(f for f in finished if f is not None),
        token_times=sorted(x for t in times for x in t.token_times) if with_token_times else [],
    )
