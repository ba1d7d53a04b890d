"""The server's Prometheus metrics, kept with `prometheus_client` in a registry of the app's own.

Counters and histograms are updated when a request finishes. The gauges (running, waiting, KV
blocks, prefix-cache hit rate) and the engine's own counters (speculative decoding's among them, when
it speculates) are read at scrape time from the async engine's snapshot, never from the scheduler
while a step runs.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from ..engine.outputs import RequestOutput
from .kv_agent import Durations
from .async_engine import AsyncLLMEngine

PREFIX = "llm_runtime"


class _EngineCollector(Collector):
    """Gauges and counters read from the async engine's last snapshot when Prometheus scrapes."""

    def __init__(self, engine: AsyncLLMEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily]:
        stats = self.engine.snapshot.stats
        gauges = [
            ("num_requests_running", "sequences running", stats.num_running),
            ("num_requests_waiting", "requests waiting (validating, queued, or in the engine's queue)",
             self.engine.num_waiting),
            ("kv_blocks_used", "KV blocks in use", stats.num_used_blocks),
            ("kv_blocks_total", "KV blocks in the pool", stats.num_total_blocks),
            ("prefix_cache_hit_rate", "prompt tokens found in the prefix cache / looked up",
             stats.prefix_cache_hit_rate),
            ("engine_event_subscribers", "live views reading /v1/engine/events", len(self.engine.feed.subscribers)),
        ]
        for name, help_text, value in gauges:
            yield GaugeMetricFamily(f"{PREFIX}_{name}", help_text, value=value)
        counters = [
            ("requests_aborted", "requests cancelled before they finished", self.engine.num_aborted),
            ("requests_failed", "requests a failed step finished with an error", stats.num_failed_requests),
            ("preemptions", "sequences preempted", stats.num_preemptions),
            # In tokens, as vLLM counts them: unlike the hit-rate gauge, these sum over replicas.
            ("prefix_cache_queries", "prompt tokens looked up in the prefix cache", stats.prefix_cache_queried_tokens),
            ("prefix_cache_hits", "prompt tokens found in the prefix cache", stats.prefix_cache_hit_tokens),
            ("engine_event_subscribers_dropped", "live views dropped for not keeping up with /v1/engine/events",
             self.engine.feed.num_dropped),
        ]
        agent = self.engine.kv_transfer
        if agent is not None:  # disaggregated prefill and decode (lesson 18)
            kv = agent.snapshot()
            counters += [
                ("kv_transfer_sent_tokens", "prompt tokens whose KV blocks this server shipped", kv.sent_tokens),
                ("kv_transfer_sent_bytes", "bytes of KV messages shipped (handed to the transport)", kv.sent_bytes),
                ("kv_transfer_received_tokens", "prompt tokens whose KV blocks this server took in",
                 kv.received_tokens),
                ("kv_transfer_received_bytes", "bytes of KV messages received", kv.received_bytes),
                ("kv_transfer_refused", "KV messages refused (another layout, cut, no room)", kv.refused_transfers),
                ("kv_transfer_expired", "KV blocks received that no request claimed in time", kv.expired_transfers),
                ("kv_transfer_send_failures", "KV messages that could not be shipped", kv.send_failures),
            ]
            for name, help_text, seconds in (("kv_transfer_send_seconds", "reading and shipping one prompt's blocks",
                                              kv.send_seconds),
                                             ("kv_transfer_import_seconds", "taking one prompt's blocks into the pool",
                                              kv.import_seconds)):
                yield _histogram(f"{PREFIX}_{name}", help_text, seconds)
        if stats.accepted_length_counts:  # speculative decoding (lesson 14), as vLLM's spec_decode metrics
            counters += [
                ("spec_decode_num_draft_tokens", "speculative drafts verified", stats.num_draft_tokens),
                ("spec_decode_num_accepted_tokens", "speculative drafts kept", stats.num_accepted_tokens),
            ]
            accepted = CounterMetricFamily(f"{PREFIX}_spec_decode_num_verifications",
                                           "verifications by the number of drafts kept", labels=["num_accepted"])
            for num_accepted, count in enumerate(stats.accepted_length_counts):
                accepted.add_metric([str(num_accepted)], count)
            yield accepted
            yield GaugeMetricFamily(f"{PREFIX}_spec_decode_acceptance_rate", "drafts kept / drafts verified",
                                    value=stats.acceptance_rate)
            yield GaugeMetricFamily(f"{PREFIX}_spec_decode_mean_acceptance_length",
                                    "tokens gained per verification: kept drafts + the token after them",
                                    value=stats.mean_acceptance_length)
        for name, help_text, value in counters:
            yield CounterMetricFamily(f"{PREFIX}_{name}", help_text, value=value)


def _histogram(name: str, help_text: str, durations: Durations) -> HistogramMetricFamily:
    """A histogram of what `durations` observed (seconds)."""
    buckets = [(str(bound), count) for bound, count in zip(durations.bounds, durations.counts)]
    return HistogramMetricFamily(name, help_text, buckets=buckets + [("+Inf", durations.count)],
                                 sum_value=durations.total)


class ServerMetrics:
    """Everything `/metrics` shows, in one registry per app (no process-wide state)."""

    def __init__(self, engine: AsyncLLMEngine) -> None:
        self.registry = CollectorRegistry()
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "prompt tokens of finished requests",
                                     registry=self.registry)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "tokens generated by finished requests",
                                         registry=self.registry)
        self.requests_finished = Counter(f"{PREFIX}_requests_finished", "completions finished, by reason",
                                         ["finish_reason"], registry=self.registry)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "time to first token", registry=self.registry,
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0))
        self.itl = Histogram(f"{PREFIX}_inter_token_latency_seconds", "time between consecutive tokens",
                             registry=self.registry, buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5))
        self.e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds", "arrival to the last token",
                             registry=self.registry, buckets=(0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0))
        self.registry.register(_EngineCollector(engine))

    def record(self, output: RequestOutput, num_generated_tokens: int) -> None:
        """A request's final output (its completions' tokens counted by the caller, who saw every delta)."""
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.generation_tokens.inc(num_generated_tokens)
        for completion in output.outputs:
            self.requests_finished.labels(completion.finish_reason or "unknown").inc()
        metrics = output.metrics
        if metrics.first_token_time is not None:
            self.ttft.observe(metrics.first_token_time - metrics.arrival_time)
        if metrics.latency is not None:
            self.e2e.observe(metrics.latency)
        for a, b in zip(metrics.token_times, metrics.token_times[1:]):
            self.itl.observe(b - a)

    def render(self) -> bytes:
        return generate_latest(self.registry)
