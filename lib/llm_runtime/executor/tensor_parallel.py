"""`TensorParallelExecutor`: the same executor over tensor_parallel_size ranks (lesson 17).

Rank 0 is this process: its worker holds rank 0's shard and runs the step as one rank would, its runner sending
each step's inputs to the other ranks first (worker/step_channel.py). Ranks 1 .. size - 1 are processes
(rank_processes.py) that run the same `Worker` code over their own shards. What differs from one rank is said
here: the other ranks are told the plan and the pool's size before rank 0 calibrates or compiles (their
collectives meet), rank 0 computes with its share of the CPU's cores while they compute beside it, and a step that
failed in its forward pass cannot be run again (the ranks stopped at different points of it).
"""

from __future__ import annotations

import contextlib

import torch

from ..config import EngineConfig
from ..distributed.launch import torch_threads
from ..distributed.sharding import shard_model_, tensor_parallel_unsupported_reason
from ..errors import SamplingError, is_device_fault
from ..model import CausalLM
from ..model.tokenizer import Tokenizer
from ..worker.model_runner import ModelRunner
from .executor import Executor
from .rank_processes import RankSetup, ShardWorkers, WorkerSpec

DEATH_NOTICE_S = 1.0  # after a failed step, how long a dead rank's exit may take to be reported


class TensorParallelExecutor(Executor):
    """Rank 0's worker and its handle on the other ranks (`workers`)."""

    def __init__(self, model: CausalLM, tokenizer: Tokenizer | None, config: EngineConfig, *, owns_model: bool,
                 draft_model: CausalLM | None, context_len: int, workers: ShardWorkers | None = None) -> None:
        """`workers`: the other ranks, when `model` is already rank 0's shard of their group (LLM(...) starts them
        and loads only this rank's shard); else they are started here from the model's name, and this rank's shard
        is cut from `model` in place. A half-built executor leaves no worker behind."""
        self.workers = workers
        try:
            self.workers = self._start_or_check(model, config, workers)
            super().__init__(model, tokenizer, config, owns_model=owns_model, draft_model=draft_model,
                             context_len=context_len)
        except BaseException:
            if self.workers is not None:
                self.workers.close()
            raise

    @staticmethod
    def _start_or_check(model: CausalLM, config: EngineConfig, workers: ShardWorkers | None) -> ShardWorkers:
        size = config.tensor_parallel_size
        if workers is None:
            reason = tensor_parallel_unsupported_reason(model.config, size)
            if reason is not None:
                raise ValueError(reason)
            if model.source is None:
                raise ValueError("tensor_parallel_size > 1 starts workers that load the model by its name, and "
                                 "this model has none: load it with load_model(...) or LLM(...)")
            if model.tp is not None:
                raise ValueError("this model is already a shard: pass the workers that hold the other shards")
            check_tensor_parallel_budget(config, model.device)
            spec = WorkerSpec(model.source or None, model.device.type, str(model.dtype).removeprefix("torch."),
                              timeout_s=config.tensor_parallel_timeout_s)
            workers = ShardWorkers.start(spec, size)
            try:
                shard_model_(model, workers.tp)
            except BaseException:
                workers.close()
                raise
        if model.tp is None or model.tp.size != size or model.tp is not workers.tp:
            workers.close()
            raise ValueError(f"the model is not rank 0's shard of the workers' group of {size}")
        return workers

    def _configure_ranks(self, calibration: list[int] | None) -> None:
        assert self.workers is not None
        self.workers.configure(RankSetup(self.plan, self.num_blocks, self.max_model_len,
                                         None if calibration is None else tuple(calibration)))

    def _attach(self, runner: ModelRunner) -> None:
        assert self.workers is not None
        if runner.graphs is not None or runner.native is not None:  # the plan chooses neither under TP
            raise RuntimeError("a tensor-parallel runner replays no CUDA graph and runs no native step")
        runner.channel = self.workers.channel  # each step's inputs go to the other ranks, which compute it too

    def _patience(self) -> contextlib.AbstractContextManager[object] | None:
        assert self.workers is not None
        return self.workers.tp.patient()  # the warm-up's collectives meet the workers', whose compilers finish when they do

    def compute_threads(self) -> contextlib.AbstractContextManager[None]:
        """Rank 0's share of the CPU's cores while the workers compute beside it (distributed/launch.py)."""
        assert self.workers is not None
        return torch_threads(self.workers.num_threads)

    def step_failed(self, error: Exception) -> BaseException | None:
        """A step that failed in its forward pass leaves the ranks at different points of it: none can be retried,
        and the engine dies. One that failed in sampling (SamplingError) had finished every collective."""
        if not is_device_fault(error) and isinstance(error, SamplingError):
            return None
        assert self.workers is not None
        self.workers.failed = True
        dead = self.workers.check(grace_s=DEATH_NOTICE_S)
        return error if dead is None else RuntimeError(dead)

    def check_health(self) -> str | None:
        assert self.workers is not None
        return self.workers.check()

    def shutdown(self) -> None:
        super().shutdown()
        if self.workers is not None:
            self.workers.close()


def check_tensor_parallel_budget(config: EngineConfig, device: torch.device) -> None:
    """On CUDA the KV budget comes from a profiled forward pass on rank 0 alone, which the other ranks would not
    join: a tensor-parallel engine there needs the pool's size given."""
    if device.type == "cuda" and config.num_kv_blocks is None and config.kv_cache_memory is None:
        raise ValueError("tensor_parallel_size > 1 on CUDA needs num_kv_blocks or kv_cache_memory (the memory "
                         "profile runs one rank's forward pass, not yet every rank's)")
