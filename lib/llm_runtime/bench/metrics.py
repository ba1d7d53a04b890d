"""Serving metrics, defined as vLLM's serving benchmark defines them, so numbers compare across engines.

Per request, from its timestamps (seconds; the request is *sent* at `start`):
- TTFT, time to first token: first token - start.
- E2EL, end-to-end latency: last token - start.
- TPOT, time per output token: (E2EL - TTFT) / (output tokens - 1); only for 2+ output tokens.
- ITL, inter-token latencies: the gaps between consecutive tokens (every gap of every request).
Per run, over its wall-clock `duration`: requests/s, output tokens/s, (input + output) tokens/s,
and goodput: requests/s that met every latency target given. Each latency is summarised by its
mean, median, p90 and p99 (numpy's linear-interpolation percentiles, as vLLM uses).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass(frozen=True)
class RequestTiming:
    """When one request was sent and when each of its output tokens arrived (perf_counter seconds)."""

    start: float
    token_times: tuple[float, ...]
    num_prompt_tokens: int

    def __post_init__(self) -> None:
        if not self.token_times:
            raise ValueError("a request with no output token has no latency metrics")
        if any(b < a for a, b in zip(self.token_times, self.token_times[1:])) or self.token_times[0] < self.start:
            raise ValueError("token times must not decrease and must not precede the start")

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_times)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.start

    @property
    def e2el(self) -> float:
        return self.token_times[-1] - self.start

    @property
    def tpot(self) -> float | None:
        if self.num_output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.num_output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


@dataclass(frozen=True)
class LatencyStats:
    """mean, median, p90 and p99 of one latency metric, in seconds."""

    mean: float
    median: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> "LatencyStats":
        if not values:
            return cls(float("nan"), float("nan"), float("nan"), float("nan"))
        array = np.asarray(values, dtype=np.float64)
        p50, p90, p99 = np.percentile(array, [50, 90, 99])
        return cls(float(array.mean()), float(p50), float(p90), float(p99))


@dataclass(frozen=True)
class LatencyTargets:
    """Service-level objectives for goodput, in seconds; None means no target on that metric."""

    ttft: float | None = None
    tpot: float | None = None
    e2el: float | None = None

    def met_by(self, request: RequestTiming) -> bool:
        tpot = request.tpot
        return ((self.ttft is None or request.ttft <= self.ttft)
                and (self.tpot is None or tpot is None or tpot <= self.tpot)
                and (self.e2el is None or request.e2el <= self.e2el))


@dataclass(frozen=True)
class BenchmarkMetrics:
    """A run's throughput and latency summary."""

    num_requests: int
    duration: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2el: LatencyStats
    goodput: float | None = None
    targets: LatencyTargets | None = field(default=None)

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(requests: Sequence[RequestTiming], duration: float,
              targets: LatencyTargets | None = None) -> BenchmarkMetrics:
    """Throughput over `duration` seconds and latency statistics of `requests`."""
    if duration <= 0:
        raise ValueError(f"duration must be > 0, got {duration}")
    if not requests:
        raise ValueError("no request to summarise")
    input_tokens = sum(r.num_prompt_tokens for r in requests)
    output_tokens = sum(r.num_output_tokens for r in requests)
    goodput = None
    if targets is not None:
        goodput = sum(targets.met_by(r) for r in requests) / duration
    return BenchmarkMetrics(
        num_requests=len(requests),
        duration=duration,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=len(requests) / duration,
        output_throughput=output_tokens / duration,
        total_token_throughput=(input_tokens + output_tokens) / duration,
        ttft=LatencyStats.of([r.ttft for r in requests]),
        tpot=LatencyStats.of([t for r in requests if (t := r.tpot) is not None]),
        itl=LatencyStats.of([gap for r in requests for gap in r.itls]),
        e2el=LatencyStats.of([r.e2el for r in requests]),
        goodput=goodput,
        targets=targets,
    )
