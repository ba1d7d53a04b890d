"""Scheduler: FCFS admission under the sequence cap and token budget, chunked prefill, decode first."""

from __future__ import annotations

from llm_runtime import EngineConfig, SamplingParams, Scheduler, Sequence, SequenceStatus
from llm_runtime.core.block_manager import BlockManager


def _scheduler(num_blocks: int = 64, block_size: int = 4, **config) -> Scheduler:
    return Scheduler(EngineConfig(**config), BlockManager(num_blocks, block_size))


def _seq(request_id: str, prompt_len: int, max_tokens: int = 4) -> Sequence:
    return Sequence(request_id, [1] * prompt_len, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                    max_new_tokens=max_tokens)


def _sampled(batch, tokens: list[int]) -> dict:
    """The runner's result for `batch`: tokens[i] for the i-th item that samples."""
    return dict(zip([item.seq for item in batch.items if item.samples], tokens))


def _plan(batch) -> list[tuple[str, int, int]]:
    return [(item.seq.request_id, item.start, item.num_new_tokens) for item in batch.items]


def test_fcfs_admission_chunked_prefill_and_decode_first() -> None:
    scheduler = _scheduler(max_num_seqs=3, max_num_batched_tokens=10)
    for request_id, length in [("a", 4), ("b", 9), ("c", 2), ("d", 1)]:
        scheduler.add(_seq(request_id, length))
    first = scheduler.schedule()
    assert _plan(first) == [("a", 0, 4), ("b", 0, 6)]  # b's prompt is split: 6 now, 3 next step
    assert [item.samples for item in first.items] == [True, False]
    scheduler.postprocess(first, _sampled(first, [7]), now=1.0)
    second = scheduler.schedule()
    # Running first (a decodes 1, b finishes its prompt), then c joins; d waits: 3 running is the cap.
    assert _plan(second) == [("a", 4, 1), ("b", 6, 3), ("c", 0, 2)]
    assert [s.request_id for s in scheduler.waiting] == ["d"]
    assert second.num_prefill_tokens == 5 and second.num_decode_tokens == 1


def test_finished_sequences_leave_and_free_their_slot_at_once() -> None:
    scheduler = _scheduler(max_num_seqs=1, max_num_batched_tokens=8)
    scheduler.add(_seq("a", 3, max_tokens=1))
    scheduler.add(_seq("b", 2, max_tokens=1))
    batch = scheduler.schedule()
    assert _plan(batch) == [("a", 0, 3)]
    finished = scheduler.postprocess(batch, _sampled(batch, [5]), now=1.0)
    assert [s.request_id for s in finished] == ["a"] and finished[0].status is SequenceStatus.FINISHED_LENGTH
    assert _plan(scheduler.schedule()) == [("b", 0, 2)]


def test_no_chunking_waits_for_a_step_with_room() -> None:
    scheduler = _scheduler(max_num_seqs=4, max_num_batched_tokens=8, enable_chunked_prefill=False)
    scheduler.add(_seq("a", 5))
    scheduler.add(_seq("b", 5))
    assert _plan(scheduler.schedule()) == [("a", 0, 5)]  # b would need splitting: it waits
    assert [s.request_id for s in scheduler.waiting] == ["b"]


def test_abort_removes_waiting_and_running() -> None:
    scheduler = _scheduler(max_num_seqs=1, max_num_batched_tokens=8)
    scheduler.add(_seq("a", 3))
    scheduler.add(_seq("b", 3))
    scheduler.schedule()
    assert [s.status for s in scheduler.abort("a")] == [SequenceStatus.FINISHED_ABORTED]
    assert [s.request_id for s in scheduler.abort("b")] == ["b"]
    assert not scheduler.has_unfinished()


def test_admission_waits_until_the_prompt_blocks_fit() -> None:
    scheduler = _scheduler(num_blocks=4, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    scheduler.add(_seq("a", 10))  # 3 blocks
    scheduler.add(_seq("b", 8))  # 2 blocks: only 1 left
    assert _plan(scheduler.schedule()) == [("a", 0, 10)]
    assert [s.request_id for s in scheduler.waiting] == ["b"]


def test_the_newest_running_sequence_is_preempted_when_decodes_outgrow_the_pool() -> None:
    scheduler = _scheduler(num_blocks=3, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = _seq("a", 4), _seq("b", 7)
    scheduler.add(a)
    scheduler.add(b)
    first = scheduler.schedule()
    assert _plan(first) == [("a", 0, 4), ("b", 0, 7)] and scheduler.block_manager.num_free_blocks == 0
    scheduler.postprocess(first, _sampled(first, [5, 6]), now=1.0)
    # a's token 4 needs a new block; none is free, so b (the newest) gives its two back.
    assert _plan(scheduler.schedule()) == [("a", 4, 1)]
    assert list(scheduler.waiting) == [b] and b.status is SequenceStatus.WAITING
    assert b.num_computed_tokens == 0 and b.output_token_ids == [6] and scheduler.num_preemptions == 1
