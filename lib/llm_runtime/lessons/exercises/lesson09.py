"""Lesson 09 exercises: serving metrics as vLLM's benchmark defines them, checked against `bench/metrics.py`.

- `request_latencies(start, token_times)`: one request's TTFT, TPOT, inter-token latencies and
  end-to-end latency, against `RequestTiming`.
- `goodput(requests, duration, ttft_target, tpot_target)`: requests per second that met every
  latency target, against `summarize(..., LatencyTargets(...)).goodput`.
- `latency_percentile(values, q)`: a percentile by linear interpolation (numpy's default, what vLLM
  reports), against `LatencyStats.of` (its median, p90 and p99).
"""

from __future__ import annotations

import random

from ...bench.metrics import LatencyStats, LatencyTargets, RequestTiming, summarize
from .check import Case, Verdict, close_numbers, run_cases


def _times(rng: random.Random, num_tokens: int) -> tuple[float, list[float]]:
    """A start and token times on a 1/8 s grid (exact in binary: equal latencies compare equal)."""
    start = rng.randint(0, 40) / 8
    times, now = [], start + rng.randint(0, 24) / 8
    for _ in range(num_tokens):
        times.append(now)
        now += rng.randint(0, 6) / 8
    return start, times


def check_request_latencies(fn: object) -> Verdict:
    """`request_latencies(start, token_times) -> (ttft, tpot, itls, e2el)`: a request sent at `start`
    received its output tokens at `token_times` (seconds, non-decreasing, at least one). Return the time
    to first token, the time per output token after the first ((last - first) / (tokens - 1); None for
    a one-token request), the list of gaps between consecutive tokens, and the end-to-end latency."""

    def cases() -> list[Case]:
        rng = random.Random(9)
        inputs = [(1.0, [1.5], "one token: no TPOT"), (0.0, [2.0, 2.5, 3.5], "three tokens")]
        inputs += [(*_times(rng, rng.randint(1, 8)), "") for _ in range(30)]
        out = []
        for start, times, note in inputs:
            timing = RequestTiming(start, tuple(times), num_prompt_tokens=1)
            out.append(Case({"start": start, "token_times": times},
                            (timing.ttft, timing.tpot, timing.itls, timing.e2el), note))
        return out

    def compare(expected: tuple, got: object) -> str | None:
        if not isinstance(got, (tuple, list)) or len(got) != 4:
            return "expected a tuple (ttft, tpot, itls, e2el)"
        for name, e, g in zip(("ttft", "tpot", "itls", "e2el"), expected, got):
            difference = close_numbers(rel_tol=1e-9, abs_tol=1e-12)(e, list(g) if isinstance(g, tuple) else g)
            if difference is not None:
                return f"{name} differs" + (f": {difference}" if difference else "")
        return None

    return run_cases("request_latencies", fn, cases, compare, "llm_runtime.bench.metrics.RequestTiming")


def check_goodput(fn: object) -> Verdict:
    """`goodput(requests, duration, ttft_target, tpot_target) -> float`: `requests` is a list of
    (start, token_times) pairs, `duration` the run's wall time in seconds; a target of None means no
    target on that metric. A request meets the targets when its TTFT is at most ttft_target and its
    TPOT at most tpot_target (a one-token request has no TPOT and meets any TPOT target). Return the
    number of requests that meet every target, per second of the run."""

    def cases() -> list[Case]:
        rng = random.Random(9)
        out = []
        for number in range(30):
            requests = [_times(rng, rng.randint(1, 6)) for _ in range(rng.randint(1, 8))]
            timings = [RequestTiming(start, tuple(times), num_prompt_tokens=1) for start, times in requests]
            # Targets often equal to some request's own figure: "at most" includes the boundary.
            ttft = rng.choice([None, rng.choice(timings).ttft, rng.randint(0, 24) / 8])
            tpots = [t.tpot for t in timings if t.tpot is not None]
            tpot = rng.choice([None, rng.choice(tpots) if tpots else None, rng.randint(0, 6) / 8])
            if number < 2:  # one target at a time first
                ttft, tpot = (rng.choice(timings).ttft, None) if number == 0 else (None, 0.25)
            duration = max(t for _, times in requests for t in times) + rng.randint(1, 8) / 8
            metrics = summarize(timings, duration, LatencyTargets(ttft=ttft, tpot=tpot))
            out.append(Case({"requests": requests, "duration": duration, "ttft_target": ttft, "tpot_target": tpot},
                            metrics.goodput))
        return out

    return run_cases("goodput", fn, cases, close_numbers(rel_tol=1e-9), "llm_runtime.bench.metrics.summarize")


def check_latency_percentile(fn: object) -> Verdict:
    """`latency_percentile(values, q) -> float`: the q-th percentile (q in [0, 100]) of a non-empty list of
    latencies by linear interpolation: sort them, take the (possibly fractional) rank q / 100 x (n - 1)
    counted from 0, and interpolate between the two values around it."""

    def cases() -> list[Case]:
        rng = random.Random(9)
        out = []
        for values in ([3.0], [1.0, 2.0], [5.0, 1.0, 4.0, 2.0, 3.0]):
            stats = LatencyStats.of(values)
            out += [Case({"values": values, "q": q}, getattr(stats, name)) for q, name in ((50, "median"), (90, "p90"))]
        for _ in range(20):
            values = [round(rng.uniform(0.01, 2.0), 4) for _ in range(rng.randint(1, 30))]
            stats = LatencyStats.of(values)
            q, name = rng.choice([(50, "median"), (90, "p90"), (99, "p99")])
            out.append(Case({"values": values, "q": q}, getattr(stats, name)))
        return out

    return run_cases("latency_percentile", fn, cases, close_numbers(rel_tol=1e-9, abs_tol=1e-12),
                     "llm_runtime.bench.metrics.LatencyStats.of")
