"""Lesson 18 exercises: the bytes a prompt's KV costs on the wire, goodput under latency targets, and the replica a
cache-aware router picks.

- `shipped_kv_bytes(prompt_len, block_size, num_layers, num_kv_heads, head_dim, bytes_per_value)`: against
  `lessons.disaggregation.shipped_kv_bytes` (which the tests hold equal to a real payload's bytes).
- `goodput(timings, duration_s, ttft_s, tpot_s)`: requests per second that met both targets, against
  `bench.metrics.summarize(...).goodput`.
- `cache_aware_choice(hashes, remembered, in_flight, min_match)`: against `serving.router_policy.cache_aware_choice`.
"""

from __future__ import annotations

import random
from typing import Any

from ...bench.metrics import LatencyTargets, RequestTiming, summarize
from ...serving.router_policy import cache_aware_choice as reference_cache_aware_choice
from ..disaggregation import shipped_kv_bytes as reference_shipped_kv_bytes
from .check import Case, Verdict, close_numbers, run_cases, same_value


def check_shipped_kv_bytes(fn: object) -> Verdict:
    """`shipped_kv_bytes(prompt_len, block_size, num_layers, num_kv_heads, head_dim, bytes_per_value) -> int`: the
    producer ships the whole blocks of the prompt before its last token (the consumer computes that token itself);
    each token costs a key and a value of `head_dim` values per KV head per layer, `bytes_per_value` bytes each."""

    def cases() -> list[Case]:
        shapes = [(2000, 16, 30, 3, 64, 4, "the bundled model in float32, 2,000 tokens"),
                  (2000, 16, 30, 3, 64, 1, "an int8 pool"), (16, 16, 30, 3, 64, 4, "one block: its last token is "
                                                                                   "computed there, nothing ships"),
                  (17, 16, 30, 3, 64, 2, "17 tokens: one whole block before the last"),
                  (1, 16, 2, 1, 8, 4, "a prompt of one token"), (4096, 32, 80, 8, 128, 2, "Llama-3-70B, bfloat16"),
                  (33, 16, 4, 2, 16, 4, "")]
        rng = random.Random(18)
        for _ in range(8):
            shapes.append((rng.randrange(1, 3000), rng.choice([8, 16, 32]), rng.randrange(1, 40), rng.choice([1, 2, 8]),
                           rng.choice([32, 64, 128]), rng.choice([1, 2, 4]), ""))
        return [Case({"prompt_len": p, "block_size": b, "num_layers": l, "num_kv_heads": k, "head_dim": d,
                      "bytes_per_value": v}, reference_shipped_kv_bytes(p, b, l, k, d, v), note)
                for p, b, l, k, d, v, note in shapes]

    return run_cases("shipped_kv_bytes", fn, cases, same_value, "llm_runtime.lessons.disaggregation.shipped_kv_bytes")


def check_goodput(fn: object) -> Verdict:
    """`goodput(timings, duration_s, ttft_s, tpot_s) -> float`: `timings` is a list of `RequestTiming` (`.ttft`,
    `.tpot`, which is None for a request of one token); goodput is the number of requests whose TTFT is at most
    `ttft_s` and whose TPOT is at most `tpot_s` (a request without a TPOT meets that target), per second of
    `duration_s`."""

    def cases() -> list[Case]:
        rng = random.Random(18)
        out = []
        for n, note in [(1, "one request"), (6, ""), (20, ""), (3, "some requests of one token")]:
            timings = []
            for i in range(n):
                start = rng.uniform(0, 5)
                first = start + rng.uniform(0.05, 3)
                tokens = 1 if note.startswith("some") and i % 2 == 0 else rng.randrange(2, 40)
                times = [first]
                for _ in range(tokens - 1):
                    times.append(times[-1] + rng.uniform(0.01, 0.2))
                timings.append(RequestTiming(start, tuple(times), rng.randrange(10, 500)))
            duration = max(t.token_times[-1] for t in timings) + rng.uniform(0, 2)
            for ttft, tpot in [(1.0, 0.1), (2.0, 0.05), (0.01, 1.0), (10.0, 10.0)]:
                expected = summarize(timings, duration, LatencyTargets(ttft=ttft, tpot=tpot)).goodput
                out.append(Case({"timings": timings, "duration_s": duration, "ttft_s": ttft, "tpot_s": tpot},
                                expected, note))
        return out

    return run_cases("goodput", fn, cases, close_numbers(), "llm_runtime.bench.metrics.summarize")


def _hashes(*values: int) -> list[bytes]:
    return [bytes([v]) for v in values]


def check_cache_aware_choice(fn: object) -> Verdict:
    """`cache_aware_choice(hashes, remembered, in_flight, min_match) -> int`: `hashes` are a prompt's chained chunk
    hashes, `remembered[i]` the set of hashes sent to replica i so far, `in_flight[i]` its requests in flight.
    A replica's match is how many of the prompt's hashes, from the first, it has seen without a gap. Return the
    replica of the longest match (the first of equals) if that match is at least one hash and at least
    `min_match` x len(hashes); else the least loaded replica (the first of equals)."""

    def cases() -> list[Case]:
        a, b = set(_hashes(1, 2, 3, 4)), set(_hashes(1, 2))
        table: list[tuple[list[bytes], list[Any], list[int], float, str]] = [
            (_hashes(1, 2, 3, 4), [b, a], [0, 5], 0.5, "the longer match wins over the load"),
            (_hashes(9, 8, 7), [a, b], [3, 1], 0.5, "nobody saw it: the least loaded"),
            (_hashes(1, 2, 3, 4, 5, 6, 7, 8), [b, set()], [4, 0], 0.5, "a match of 2 of 8 is too short"),
            ([], [a, b], [2, 2], 0.5, "no whole chunk: the least loaded, the first of equals"),
            (_hashes(1, 3, 4), [a, b], [0, 0], 0.5, "a gap ends the match: 1 of 3 for both, too short"),
            (_hashes(1, 2, 3), [b, b], [1, 0], 0.5, "equal matches: the first"),
            (_hashes(1, 2, 3, 4), [b, a, a], [0, 9, 2], 1.0, "min_match 1: only a whole match counts"),
            (_hashes(5, 6), [set(_hashes(6)), set(_hashes(5))], [0, 1], 0.5, "the second saw the first chunk"),
        ]
        rng = random.Random(18)
        for _ in range(20):
            replicas = rng.randrange(1, 5)
            remembered = [set(_hashes(*rng.sample(range(10), rng.randrange(0, 8)))) for _ in range(replicas)]
            hashes = _hashes(*rng.sample(range(10), rng.randrange(0, 6)))
            table.append((hashes, remembered, [rng.randrange(0, 4) for _ in range(replicas)],
                          rng.choice([0.0, 0.3, 0.5, 1.0]), ""))
        return [Case({"hashes": h, "remembered": r, "in_flight": f, "min_match": m},
                     reference_cache_aware_choice(h, r, f, m), note) for h, r, f, m, note in table]

    return run_cases("cache_aware_choice", fn, cases, same_value, "llm_runtime.serving.router_policy.cache_aware_choice")
