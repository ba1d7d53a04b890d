"""`run_on_ranks` (distributed/launch.py): what ranks return reaches the caller whole, even when a rank ends the
moment it has returned, and a rank that raises fails the call with its traceback."""

from __future__ import annotations

import multiprocessing
import os

import pytest
import torch

from llm_runtime.distributed.group import TensorParallelGroup
from llm_runtime.distributed.launch import RANK_PRELOAD, rank_context, run_on_ranks
from llm_runtime.lessons.tensor_parallel import StepTimes  # (importing it registers it: see the last test)


def _many_tensors(tp: TensorParallelGroup) -> list[torch.Tensor]:
    return [torch.full((3,), float(i + tp.rank)) for i in range(2000)]


def _raises(tp: TensorParallelGroup) -> None:
    if tp.rank == 1:
        raise ValueError("rank 1 says no")


def test_tensors_arrive_whole_from_ranks_that_end_at_once() -> None:
    # Sent as shared-memory file descriptors, 2,000 tensors took longer to fetch than the rank took to exit:
    # FileNotFoundError on every run. Sent as bytes, they arrive whole and in ordinary memory.
    values = run_on_ranks(_many_tensors, 2)
    for rank, tensors in enumerate(values):
        assert len(tensors) == 2000 and not tensors[7].is_shared()
        assert torch.equal(torch.stack(tensors)[:, 0], torch.arange(2000, dtype=torch.float32) + rank)


def test_a_rank_that_raises_fails_the_call_with_its_traceback() -> None:
    with pytest.raises(RuntimeError, match="rank 1 failed:(.|\n)*rank 1 says no"):
        run_on_ranks(_raises, 2)


class _NotRegistered:
    def __init__(self) -> None:
        self.value = 1


def _an_object(tp: TensorParallelGroup) -> object:
    return _NotRegistered()


def _step_times(tp: TensorParallelGroup) -> StepTimes:
    return StepTimes(tp.rank, tp.size, 1, 0.0, 1.0, [("all-reduce", 0.1, 0.2)])


def test_what_ranks_send_back_is_loaded_as_data_only() -> None:
    """weights_only=True: an object of a class nobody registered is refused (unpickling it could run its code);
    the lessons' result types are registered, and arrive."""
    with pytest.raises(Exception, match="Weights only load failed|weights_only"):
        run_on_ranks(_an_object, 2)
    times = run_on_ranks(_step_times, 2)
    assert [t.rank for t in times] == [0, 1] and times[1].events == [("all-reduce", 0.1, 0.2)]


def test_cpu_ranks_fork_from_a_server_with_torch_imported_and_cuda_ranks_are_spawned() -> None:
    """A CPU rank starts as a fork of one server per process that has torch and the rank code imported (an engine
    at 2 ranks started 4 s faster than with a fresh interpreter per rank); a CUDA rank needs a fresh interpreter."""
    assert rank_context("cuda").get_start_method() == "spawn"
    if "forkserver" in multiprocessing.get_all_start_methods():
        assert rank_context("cpu").get_start_method() == "forkserver"
        assert "torch" in RANK_PRELOAD and not any(name.startswith("llm_runtime") for name in RANK_PRELOAD)


def _read_variable(tp: TensorParallelGroup, name: str) -> str | None:
    return os.environ.get(name)


def test_each_rank_takes_the_callers_environment_of_the_moment(monkeypatch: pytest.MonkeyPatch) -> None:
    """A forked rank would have the fork server's environment, frozen when the first rank started; each takes the
    caller's as it is when the rank starts, as a spawned one does."""
    monkeypatch.setenv("LLM_RUNTIME_TEST_MARK", "first")
    assert run_on_ranks(_read_variable, 2, "LLM_RUNTIME_TEST_MARK") == ["first", "first"]
    monkeypatch.setenv("LLM_RUNTIME_TEST_MARK", "second")
    assert run_on_ranks(_read_variable, 2, "LLM_RUNTIME_TEST_MARK") == ["second", "second"]
    monkeypatch.delenv("LLM_RUNTIME_TEST_MARK")
    assert run_on_ranks(_read_variable, 2, "LLM_RUNTIME_TEST_MARK") == [None, None]


def test_every_rank_reports_the_same_timed_step(tiny_checkpoints) -> None:
    """Lesson 17's timeline draws one step on every rank: each rank reports the same one (their intervals overlap,
    where two different steps lie a sync apart), with as many all-reduces on each."""
    from llm_runtime.lessons.tensor_parallel import time_sharded_step

    times = run_on_ranks(time_sharded_step, 2, str(tiny_checkpoints["llama2"]), "float32", 2, 9)
    assert max(t.start for t in times) < min(t.end for t in times)
    assert times[0].all_reduces == times[1].all_reduces > 0
