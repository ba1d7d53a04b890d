"""Serving metrics on synthetic timestamps: each definition checked by hand."""

from __future__ import annotations

import math

import pytest

from llm_runtime.bench.metrics import LatencyStats, LatencyTargets, RequestTiming, summarize


def test_per_request_definitions() -> None:
    r = RequestTiming(start=10.0, token_times=(10.5, 10.7, 11.0, 11.5), num_prompt_tokens=7)
    assert r.ttft == pytest.approx(0.5)
    assert r.e2el == pytest.approx(1.5)
    assert r.tpot == pytest.approx((1.5 - 0.5) / 3)  # the first token is TTFT's, not TPOT's
    assert r.itls == pytest.approx([0.2, 0.3, 0.5])
    assert RequestTiming(0.0, (0.3,), 1).tpot is None  # one token: no time per output token


def test_run_summary_throughput_percentiles_and_goodput() -> None:
    requests = [RequestTiming(0.0, (1.0, 2.0), 10), RequestTiming(0.0, (2.0, 4.0, 6.0), 20),
                RequestTiming(1.0, (1.5,), 30)]
    m = summarize(requests, duration=6.0, targets=LatencyTargets(ttft=1.5, tpot=1.5))
    assert m.num_requests == 3 and m.total_input_tokens == 60 and m.total_output_tokens == 6
    assert m.request_throughput == pytest.approx(0.5) and m.output_throughput == pytest.approx(1.0)
    assert m.total_token_throughput == pytest.approx(11.0)
    assert m.ttft.mean == pytest.approx((1.0 + 2.0 + 0.5) / 3) and m.ttft.median == pytest.approx(1.0)
    assert m.tpot.mean == pytest.approx(1.5)  # (1.0 + 2.0) / 2: the one-token request has none
    assert m.itl.median == pytest.approx(2.0)  # gaps 1, 2, 2
    assert m.ttft.p90 == pytest.approx(1.8)  # linear interpolation between 1.0 and 2.0
    # goodput: request 0 (ttft 1.0, tpot 1.0) and request 2 (ttft 0.5) meet the targets, request 1 does not
    assert m.goodput == pytest.approx(2 / 6.0)


def test_percentiles_of_a_known_sample() -> None:
    stats = LatencyStats.of(list(range(1, 101)))  # 1 .. 100
    assert (stats.mean, stats.median) == (50.5, 50.5)
    assert stats.p90 == pytest.approx(90.1) and stats.p99 == pytest.approx(99.01)
    assert math.isnan(LatencyStats.of([]).mean)


@pytest.mark.parametrize("times", [(), (0.5, 0.4), (-1.0,)])
def test_impossible_timestamps_are_refused(times) -> None:
    with pytest.raises(ValueError):
        RequestTiming(0.0, times, 1)
