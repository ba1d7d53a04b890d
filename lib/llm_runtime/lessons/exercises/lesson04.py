"""Lesson 04 exercises: what static batching costs, in steps, checked against `StaticBatchRunner`.

The checkers run the package's real `StaticBatchRunner` (FCFS batches under `max_batch_size` and
`max_num_batched_tokens`, each batch decoded in lockstep until its last request finishes) over a
stand-in model that computes nothing, and read its step records. A step is one forward pass; every
request asks for exactly `max_tokens` tokens (EOS ignored).

- `static_token_steps(prompt_lens, max_tokens, max_batch_size, max_num_batched_tokens)`: the step at
  which each request gets its first and its last token (head-of-line blocking, in steps).
- `wasted_slots(prompt_lens, max_tokens, max_batch_size, max_num_batched_tokens)`: how many row-steps
  the batches spend on requests that have already finished.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from ...attention.kv_cache import ContiguousKVCache
from ...core.scheduler import StepRecord
from ...core.sequence import Sequence
from ...sampling import Sampler, SamplingParams
from ..static_batching import StaticBatchRunner
from .check import Case, Verdict, run_cases, same_value


class _InstantModel:
    """Stands in for `CausalLM` in `StaticBatchRunner`: no weights, every logit 0. The runner's batching,
    padding, cache bookkeeping, lockstep decoding and step records are the real ones."""

    device = torch.device("cpu")
    vocab_size = 4

    def new_kv_cache(self, batch_size: int, max_seq_len: int) -> ContiguousKVCache:
        return ContiguousKVCache(1, batch_size, max_seq_len, 1, 1, dtype=torch.float32, device=self.device)

    def __call__(self, input_ids: torch.Tensor, kv_cache: ContiguousKVCache, positions: torch.Tensor) -> torch.Tensor:
        kv_cache.advance(input_ids.shape[1])
        return torch.zeros(*input_ids.shape, 1)  # (B, T, hidden = 1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*hidden.shape[:-1], self.vocab_size)


def static_run(prompt_lens: list[int], max_tokens: list[int], max_batch_size: int,
               max_num_batched_tokens: int) -> list[StepRecord]:
    """The package's static batching over these requests; its step records."""
    model: Any = _InstantModel()
    runner = StaticBatchRunner(model, Sampler(seed=0), max_batch_size=max_batch_size,
                               max_num_batched_tokens=max_num_batched_tokens, record_steps=True)
    sequences = [Sequence(str(i), [1] * length, SamplingParams(temperature=0, max_tokens=count, ignore_eos=True),
                          max_new_tokens=count) for i, (length, count) in enumerate(zip(prompt_lens, max_tokens))]
    runner.run(sequences)
    return runner.step_records


def _inputs() -> list[tuple[dict, str]]:
    rng = random.Random(4)
    inputs = [
        (dict(prompt_lens=[5, 5, 5], max_tokens=[2, 4, 3], max_batch_size=3, max_num_batched_tokens=100), "one batch"),
        (dict(prompt_lens=[5, 5, 5], max_tokens=[2, 4, 3], max_batch_size=2, max_num_batched_tokens=100),
         "the batch size closes the first batch"),
        (dict(prompt_lens=[4, 9, 3], max_tokens=[1, 2, 5], max_batch_size=4, max_num_batched_tokens=16),
         "the padded rectangle closes it: 9 x 2 = 18 > 16"),
        (dict(prompt_lens=[30, 2], max_tokens=[3, 1], max_batch_size=4, max_num_batched_tokens=16),
         "a prompt over the budget still runs, alone"),
    ]
    for _ in range(40):
        n = rng.randint(1, 9)
        inputs.append((dict(prompt_lens=[rng.randint(1, 20) for _ in range(n)],
                            max_tokens=[rng.randint(1, 8) for _ in range(n)], max_batch_size=rng.randint(1, 4),
                            max_num_batched_tokens=rng.randint(10, 60)), ""))
    return inputs


def _first_and_last_steps(records: list[StepRecord], num_requests: int) -> list[tuple[int, int]]:
    steps: list[list[int]] = [[] for _ in range(num_requests)]
    for record in records:
        for request_id, _, num_tokens, _ in record.items:
            if num_tokens > 0:  # the row computed for its request (0: a finished request's wasted slot)
                steps[int(request_id)].append(record.index + 1)
    return [(s[0], s[-1]) for s in steps]


def check_static_token_steps(fn: object) -> Verdict:
    """`static_token_steps(prompt_lens, max_tokens, max_batch_size, max_num_batched_tokens) -> list[(int, int)]`:
    for each request of the queue (in order), the step (1-based: the first forward pass is step 1) at
    which it gets its first token and the step at which it gets its last. Batches are formed first come
    first served: a batch takes the longest prefix of the remaining queue with at most `max_batch_size`
    requests whose padded prefill (longest prompt x number of requests) is at most
    `max_num_batched_tokens`, always at least one request. A batch's first step is its prefill (each
    request gets its first token there), then one decode step per token until its longest request is done."""

    def cases() -> list[Case]:
        return [Case(args, _first_and_last_steps(static_run(**args), len(args["prompt_lens"])), note)
                for args, note in _inputs()]

    return run_cases("static_token_steps", fn, cases, same_value, "llm_runtime.StaticBatchRunner")


def check_wasted_slots(fn: object) -> Verdict:
    """`wasted_slots(prompt_lens, max_tokens, max_batch_size, max_num_batched_tokens) -> int`: with the same
    batches as `static_token_steps`, the number of (row, step) slots computed for a request that has
    already finished: its row still runs while the rest of its batch decodes."""

    def cases() -> list[Case]:
        return [Case(args, sum(1 for record in static_run(**args) for item in record.items if item[2] == 0), note)
                for args, note in _inputs()]

    return run_cases("wasted_slots", fn, cases, same_value, "llm_runtime.StaticBatchRunner")
