"""Persistent input buffers: for any ragged batch, the same ids, positions, slots, offsets, lengths and
block tables as the plain reference (`AttentionMetadata.build`), the buffers allocated once and grown
only when a step outgrows them, and a block table too short for its tokens refused."""

from __future__ import annotations

import random

import pytest
import torch

from llm_runtime import SamplingParams
from llm_runtime.attention.metadata import AttentionMetadata
from llm_runtime.worker.input_batch import InputBuffers
from llm_runtime.core.scheduler import ScheduledBatch, ScheduledSequence
from llm_runtime.core.sequence import Sequence


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


def test_a_host_buffer_is_rewritten_only_after_its_copy_to_the_device_happened() -> None:
    """The CUDA mechanism, on the CPU: with a device buffer apart from the host's (here on PyTorch's meta device),
    the steps write two host buffers in turn, an event is recorded after each step's asynchronous copy, and a
    buffer is rewritten only once the event of its previous copy was waited on, while it still held what that
    copy was to read. (Before, one buffer was rewritten whenever the next step came, copy done or not.)"""
    buffers = InputBuffers("meta", block_size=4, capacity=64)
    log: list[tuple] = []

    class Event:
        def __init__(self, step: int, buffer) -> None:
            self.step, self.buffer, self.held = step, buffer, buffer.numpy.copy()

        def synchronize(self) -> None:  # what the copy of `step` reads must still be there now
            log.append(("wait", self.step, bool((self.buffer.numpy == self.held).all())))

    step = 0

    def record():
        log.append(("record", step))
        return Event(step, buffers._hosts[buffers._turn])

    buffers._record_copy = record
    rng = random.Random(0)
    with torch.inference_mode():  # as the model runner prepares them
        for step in range(4):
            buffers.prepare(_random_batch(rng, 4))
    assert len(buffers._hosts) == 2
    assert log == [("record", 0), ("record", 1), ("wait", 0, True), ("record", 2), ("wait", 1, True), ("record", 3)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@torch.inference_mode()
def test_steps_that_sample_nothing_never_overwrite_a_pending_copy() -> None:
    """A GPU busy for longer than the host takes to prepare steps: every step's inputs arrive as they were built."""
    buffers = InputBuffers("cuda", block_size=4, capacity=1 << 12)
    rng = random.Random(1)
    seen, built = [], []
    for _ in range(16):
        torch.cuda._sleep(50_000_000)  # the GPU lags the host by tens of milliseconds
        batch = _random_batch(rng, 4)
        model_input = buffers.prepare(batch)
        built.append([t for item in batch.items for t in item.token_ids()])
        seen.append(model_input.input_ids[0].clone())  # on the stream, after the copy
    assert [ids.tolist() for ids in seen] == built
