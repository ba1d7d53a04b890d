"""The engine core needs only the executor's interface (`execute`, `step_failed`, `compute_threads`, the pool's size,
the proposer, the profile): no model, no device, no knowledge of ranks. Here it schedules and steps over an executor
that has no model at all, and over one whose steps fail as a sharded step does."""

from __future__ import annotations

import contextlib

import pytest

from llm_runtime import EngineConfig, SamplingParams
from llm_runtime.core.sequence import Sequence, SequenceStatus
from llm_runtime.engine.engine_core import EngineCore
from llm_runtime.errors import EngineDeadError
from llm_runtime.worker.model_runner import ModelRunnerOutput, StepProfile

TOKEN = 7


class CountingExecutor:
    """Every sequence that samples this step gets TOKEN; it counts the steps and the tokens it ran."""

    num_blocks = 32
    proposer = None

    def __init__(self, fail_with: Exception | None = None, fatal: bool = False) -> None:
        self.profile = StepProfile()
        self.steps: list[int] = []  # tokens per step
        self.fail_with, self.fatal = fail_with, fatal

    def execute(self, batch) -> ModelRunnerOutput:
        if self.fail_with is not None:
            raise self.fail_with
        self.steps.append(sum(item.num_new_tokens for item in batch.items))
        return ModelRunnerOutput(sampled={item.seq: TOKEN for item in batch.items if item.samples})

    def step_failed(self, error: Exception) -> BaseException | None:
        return error if self.fatal else None

    def compute_threads(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


def _sequence(request_id: str, prompt_len: int, max_tokens: int, first: int = 1) -> Sequence:
    return Sequence(request_id, list(range(first, first + prompt_len)), SamplingParams(max_tokens=max_tokens),
                    max_new_tokens=max_tokens, eos_token_ids=())


def _run(core: EngineCore, sequences: list[Sequence]) -> None:
    for seq in sequences:
        core.add([seq])
    while not all(seq.is_finished for seq in sequences):
        step = core.step(has_unfinished=True)
        assert step is not None
        core.finish_step(step, [], [])
        core.check_invariants({seq for seq in sequences if not seq.is_finished})


def test_the_core_schedules_and_steps_over_any_executor() -> None:
    executor = CountingExecutor()
    core = EngineCore(EngineConfig(max_num_seqs=4, max_num_batched_tokens=16, block_size=4), executor, None)
    sequences = [_sequence("a", 20, 3), _sequence("b", 5, 2, first=100)]
    _run(core, sequences)
    assert [seq.output_token_ids for seq in sequences] == [[TOKEN] * 3, [TOKEN] * 2]
    # Chunked (the budget's 16 tokens first), then every prompt token and every decode once: 20 + 5 + 2 + 1.
    assert executor.steps[0] == 16 and sum(executor.steps) == 28
    assert core.num_steps == len(executor.steps) == core.profile.num_steps
    assert core.block_manager.num_free_blocks == executor.num_blocks


def test_a_failure_the_executor_can_retry_fails_only_its_requests() -> None:
    executor = CountingExecutor(fail_with=RuntimeError("a bad row"))
    core = EngineCore(EngineConfig(max_num_seqs=4, block_size=4), executor, None)
    seq = _sequence("a", 6, 2)
    core.add([seq])
    step = core.step(has_unfinished=True)
    assert step is not None and seq.status is SequenceStatus.FINISHED_ERROR and core.num_failed_requests == 1


def test_a_failure_the_executor_cannot_retry_kills_the_core() -> None:
    executor = CountingExecutor(fail_with=RuntimeError("rank 2 exited"), fatal=True)
    core = EngineCore(EngineConfig(max_num_seqs=4, block_size=4), executor, None)
    core.add([_sequence("a", 6, 2)])
    with pytest.raises(EngineDeadError, match="rank 2 exited"):
        core.step(has_unfinished=True)
    with pytest.raises(EngineDeadError):
        core.step(has_unfinished=True)
