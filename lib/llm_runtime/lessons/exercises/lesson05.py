"""Lesson 05 exercises: the ragged batch and chunked prefill, checked against the model runner and the scheduler.

- `flatten_ragged(segments)`: one step's flat token ids, their positions, and which rows become
  logits, against what `ModelRunner.run` hands the model (run over a stand-in model that records it).
- `prefill_chunks(prompt_len, num_decodes, max_num_batched_tokens)`: how a new prompt is split across
  steps while other sequences decode, against the package's `Scheduler`.
"""

from __future__ import annotations

import random

import torch

from ...attention.kv_cache import PagedKVCache
from ...config import EngineConfig
from ...core.block_manager import BlockManager
from ...worker.model_runner import ModelRunner
from ...core.scheduler import ScheduledBatch, ScheduledSequence, Scheduler
from ...core.sequence import Sequence
from ...sampling import Sampler, SamplingParams
from .check import Case, Verdict, run_cases, same_value


class _Recorded(Exception):
    """Raised by the recording model once it has seen what it needs: the step stops there."""


class _RecordingModel:
    """Stands in for `CausalLM` in `ModelRunner.run`: records the flat input ids and positions, returns
    hidden states whose value is their row number, and records which rows become logits."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.input_ids: list[int] = []
        self.positions: list[int] = []
        self.logit_rows: list[int] = []

    def __call__(self, input_ids: torch.Tensor, kv_cache: object, positions: torch.Tensor) -> torch.Tensor:
        self.input_ids, self.positions = input_ids[0].tolist(), positions[0].tolist()  # (1, N) each
        return torch.arange(input_ids.shape[1], dtype=torch.float32)[None, :, None]  # (1, N, 1): row r holds r

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.logit_rows = [int(x) for x in hidden[:, 0].tolist()]
        raise _Recorded


def runner_inputs(segments: list[tuple[list[int], int, int]],
                  block_size: int = 4) -> tuple[list[int], list[int], list[int]]:
    """What the package's ModelRunner feeds the model for these (token_ids, start, num_new_tokens) segments."""
    blocks_per_seq = [-(-(start + count) // block_size) for tokens, start, count in segments]
    cache = PagedKVCache(1, sum(blocks_per_seq), block_size, 1, 1, dtype=torch.float32, device="cpu")
    model = _RecordingModel()
    runner = ModelRunner(model, Sampler(seed=0), cache)  # type: ignore[arg-type]
    batch, next_block = ScheduledBatch(), 0
    for i, ((tokens, start, count), num_blocks) in enumerate(zip(segments, blocks_per_seq)):
        seq = Sequence(f"s{i}", list(tokens), SamplingParams(), max_new_tokens=1)
        table = list(range(next_block, next_block + num_blocks))
        next_block += num_blocks
        batch.items.append(ScheduledSequence(seq, start, count, table))
    try:
        runner.run(batch)
    except _Recorded:
        pass
    return model.input_ids, model.positions, model.logit_rows


def check_flatten_ragged(fn: object) -> Verdict:
    """`flatten_ragged(segments) -> (input_ids, positions, logit_rows)`: `segments` lists one step's
    sequences as (token_ids, start, num_new_tokens): the sequence's tokens known so far, and the new
    tokens it computes this step, token_ids[start : start + num_new_tokens]. Return, as lists of ints:
    every segment's new tokens concatenated in order; the position of each (its index in its own
    sequence); and the row (index into the flat batch) of the last new token of every segment that
    reaches the end of its known tokens, in order: only those sample a next token (a prefill chunk
    that stops short of the prompt's end does not)."""

    def cases() -> list[Case]:
        rng = random.Random(5)
        inputs = [
            ([([11, 12, 13, 14, 15], 0, 5), ([21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32], 11, 1),
              ([31, 32, 33, 34, 35, 36, 37], 6, 1)], "lesson 05's A prefills, B and C decode"),
            ([([1, 2, 3, 4, 5, 6, 7, 8], 0, 3), ([9, 8, 7], 2, 1)], "a prefill chunk that stops short does not sample"),
            ([([1, 2, 3, 4, 5, 6], 4, 2)], "the last chunk of a prompt samples"),
        ]
        for _ in range(40):
            segments = []
            for _ in range(rng.randint(1, 5)):
                length = rng.randint(1, 12)
                tokens = [rng.randrange(100) for _ in range(length)]
                if rng.random() < 0.5:  # a decode: the last token
                    segments.append((tokens, length - 1, 1))
                else:  # a prefill chunk, maybe short of the end
                    start = rng.randrange(length)
                    segments.append((tokens, start, rng.randint(1, length - start)))
            inputs.append((segments, ""))
        return [Case({"segments": segments}, runner_inputs(segments), note) for segments, note in inputs]

    return run_cases("flatten_ragged", fn, cases, same_value, "llm_runtime.ModelRunner.run")


def scheduler_chunks(prompt_len: int, num_decodes: int, max_num_batched_tokens: int) -> list[int]:
    """The package's Scheduler: the prompt's chunk in each step until its prefill is done."""
    config = EngineConfig(max_num_seqs=num_decodes + 1, max_num_batched_tokens=max_num_batched_tokens,
                          enable_prefix_caching=False)
    scheduler = Scheduler(config, BlockManager(4096, 16, enable_prefix_caching=False))
    greedy = SamplingParams(temperature=0, max_tokens=None)
    for i in range(num_decodes):  # one-token prompts: after one step they all decode
        scheduler.add(Sequence(f"d{i}", [1], greedy, max_new_tokens=10**6))
    if num_decodes:
        batch = scheduler.schedule()
        scheduler.postprocess(batch, {item.seq: 0 for item in batch.items if item.samples}, now=0.0)
    prompt = Sequence("prompt", [1] * prompt_len, greedy, max_new_tokens=1)
    scheduler.add(prompt)
    chunks = []
    while prompt.is_prefill or not chunks:
        batch = scheduler.schedule()
        chunks += [item.num_new_tokens for item in batch.items if item.seq is prompt]
        scheduler.postprocess(batch, {item.seq: 0 for item in batch.items if item.samples}, now=0.0)
    return chunks


def check_prefill_chunks(fn: object) -> Verdict:
    """`prefill_chunks(prompt_len, num_decodes, max_num_batched_tokens) -> list[int]`: `num_decodes`
    sequences are decoding (one token each per step, and they go first) when a prompt of `prompt_len`
    tokens arrives; every step holds at most `max_num_batched_tokens` tokens. Return how many of the
    prompt's tokens each step computes, from the step that admits it to the step that finishes its
    prefill (chunked prefill)."""

    def cases() -> list[Case]:
        rng = random.Random(5)
        inputs = [(10, 0, 64, "the prompt fits in one step"), (10, 3, 8, "three decodes leave 5 tokens a step"),
                  (7, 4, 5, "one token a step")]
        for _ in range(30):
            num_decodes = rng.randint(0, 6)
            inputs.append((rng.randint(1, 60), num_decodes, rng.randint(num_decodes + 1, 40), ""))
        return [Case({"prompt_len": n, "num_decodes": d, "max_num_batched_tokens": b}, scheduler_chunks(n, d, b), note)
                for n, d, b, note in inputs]

    return run_cases("prefill_chunks", fn, cases, same_value, "llm_runtime.Scheduler.schedule")
