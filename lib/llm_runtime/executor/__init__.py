"""The executor layer: what runs the model for the engine core, on one process or on several.

`Executor` (executor.py) sets up rank 0's worker from the plan and runs each step; `TensorParallelExecutor`
(tensor_parallel.py) does the same over tensor_parallel_size ranks, the others being processes that run the same
`Worker` code (rank_processes.py). `make_executor` picks one from the config.
"""

from __future__ import annotations

from ..config import EngineConfig
from ..model import CausalLM
from ..model.tokenizer import Tokenizer
from .executor import Executor, UniProcExecutor
from .rank_processes import ShardWorkers, WorkerSpec, start_shard_workers
from .tensor_parallel import TensorParallelExecutor, check_tensor_parallel_budget


def make_executor(model: CausalLM, tokenizer: Tokenizer | None, config: EngineConfig, *, owns_model: bool,
                  draft_model: CausalLM | None, context_len: int, workers: ShardWorkers | None = None) -> Executor:
    """The executor `config` asks for: one process, or tensor_parallel_size ranks (`workers`: already started)."""
    options = dict(owns_model=owns_model, draft_model=draft_model, context_len=context_len)
    if config.tensor_parallel_size > 1:
        return TensorParallelExecutor(model, tokenizer, config, workers=workers, **options)
    if workers is not None:
        workers.close()
        raise ValueError("workers are for tensor_parallel_size > 1")
    return UniProcExecutor(model, tokenizer, config, **options)


__all__ = ["Executor", "ShardWorkers", "TensorParallelExecutor", "UniProcExecutor", "WorkerSpec",
           "check_tensor_parallel_budget", "make_executor", "start_shard_workers"]
