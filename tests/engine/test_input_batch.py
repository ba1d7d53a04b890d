"""Persistent input buffers: for any ragged batch, the same ids, positions, slots, offsets, lengths and
block tables as the plain reference (`AttentionMetadata.build`), the buffers allocated once and grown
only when a step outgrows them, and a block table too short for its tokens refused."""

from __future__ import annotations

import random

import pytest
import torch

from llm_runtime import SamplingParams
from llm_runtime.attention.metadata import AttentionMetadata
from llm_runtime.engine.input_batch import InputBuffers
from llm_runtime.engine.scheduler import ScheduledBatch, ScheduledSequence
from llm_runtime.engine.sequence import Sequence


def _random_batch(rng: random.Random, block_size: int, num_blocks: int = 400) -> ScheduledBatch:
    items = []
    for i in range(rng.randint(1, 12)):
        prompt = [rng.randrange(1000) for _ in range(rng.randint(1, 90))]
        seq = Sequence(f"r{i}", prompt, SamplingParams(), max_new_tokens=50)
        for _ in range(rng.choice([0, 0, rng.randint(1, 30)])):
            seq.append_token(rng.randrange(1000), 0.0)
        if seq.num_output_tokens:  # a decode: its last token
            start, count = seq.num_tokens - 1, 1
        else:  # a prefill chunk, perhaps short of the prompt's end
            start = rng.randrange(seq.num_prompt_tokens)
            count = rng.randint(1, seq.num_prompt_tokens - start)
        table = rng.sample(range(num_blocks), -(-(start + count) // block_size) + rng.randint(0, 2))
        items.append(ScheduledSequence(seq, start, count, table))
    return ScheduledBatch(items)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_prepared_inputs_equal_the_reference(block_size: int) -> None:
    rng = random.Random(block_size)
    buffers = InputBuffers("cpu", block_size, capacity=64)  # small: some batches make it grow
    for _ in range(40):
        batch = _random_batch(rng, block_size)
        items = batch.items
        model_input = buffers.prepare(batch)
        reference = AttentionMetadata.build([it.block_table for it in items], [it.start for it in items],
                                            [it.num_new_tokens for it in items], block_size=block_size, device="cpu")
        ids = [t for it in items for t in it.seq.token_ids(it.start, it.start + it.num_new_tokens)]
        positions = [p for it in items for p in range(it.start, it.start + it.num_new_tokens)]
        assert model_input.input_ids.tolist() == [ids] and model_input.positions.tolist() == [positions]
        got = model_input.metadata
        for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
            assert torch.equal(getattr(got, name), getattr(reference, name)), name
            assert getattr(got, name).dtype == getattr(reference, name).dtype, name
        for name in ("query_lens_host", "seq_lens_host", "block_tables_host"):
            assert getattr(got, name) == getattr(reference, name), name
        sampling = [i for i, it in enumerate(items) if it.samples]
        assert model_input.sampling_items == tuple(sampling)
        offsets = reference.query_start_loc.tolist()
        assert model_input.logits_indices.tolist() == [offsets[i + 1] - 1 for i in sampling]
    assert 1 < buffers.num_allocations < 6  # grown a few times from 64, not once per step


def test_a_block_table_too_short_is_refused() -> None:
    seq = Sequence("r", list(range(40)), SamplingParams(), max_new_tokens=4)
    with pytest.raises(ValueError, match="cannot hold 40 tokens"):
        InputBuffers("cpu", 16).prepare(ScheduledBatch([ScheduledSequence(seq, 0, 40, [3, 7])]))
