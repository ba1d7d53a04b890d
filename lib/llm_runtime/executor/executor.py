"""`Executor`: runs the model for the engine core, on one process or several, behind one interface.

    executor = UniProcExecutor(model, tokenizer, config, owns_model=True, context_len=2048)
    output = executor.execute(batch)     # a ScheduledBatch in, a ModelRunnerOutput out
    executor.check_health()              # None, or what went wrong with a rank
    executor.shutdown()

The set-up is the same for every executor and runs here, once, in vLLM's order: the plan is chosen
(worker/plan.py), rank 0's worker prepares its model, sizes the KV pool and allocates it, the other ranks (if any)
are told the plan and the pool's size, and every worker compiles what the plan compiles. A subclass says only what
differs with more than one rank (`_configure_ranks`, `_attach`, `compute_threads`, `_patience`, `step_failed`):
the engine core above has no tensor-parallel branch.
"""

from __future__ import annotations

import contextlib

from ..attention.kv_cache import PagedKVCache
from ..attention.kv_calibration import calibration_token_ids
from ..config import EngineConfig
from ..core.scheduler import ScheduledBatch
from ..errors import is_device_fault
from ..model import CausalLM
from ..model.tokenizer import Tokenizer
from ..spec_decode.proposer import Proposer
from ..worker.model_runner import ModelRunner, ModelRunnerOutput, StepProfile
from ..worker.plan import ModelPlan, choose_plan
from ..worker.worker import Worker


class Executor:
    """Rank 0's worker, set up for an engine (module docstring); this class runs it alone, in this process."""

    def __init__(self, model: CausalLM, tokenizer: Tokenizer | None, config: EngineConfig, *, owns_model: bool,
                 draft_model: CausalLM | None, context_len: int) -> None:
        """`context_len`: the longest context the config and the step limit allow; the pool may cut it
        (`max_model_len`). `draft_model`: an already loaded draft for a "draft" speculative config."""
        self.config = config
        self.plan: ModelPlan = choose_plan(config, model, owns_model=owns_model)
        worker = self.worker = Worker(model, self.plan)
        worker.load_model()
        worker.load_draft_model(config.speculative_config, draft_model)
        block_size = config.block_size
        self.num_blocks = worker.determine_num_blocks(config, config.max_model_len or model.config.max_position_embeddings)
        if config.max_model_len is not None and config.max_model_len > self.num_blocks * block_size:
            raise ValueError(
                f"max_model_len {config.max_model_len} needs more KV memory than the pool's {self.num_blocks} "
                f"blocks of {block_size} tokens; lower max_model_len or give the engine more KV memory "
                f"(num_kv_blocks, kv_cache_memory or gpu_memory_utilization)"
            )
        # Unless asked for, a context longer than the whole pool is not offered.
        self.max_model_len = min(context_len, self.num_blocks * block_size)
        calibration = (calibration_token_ids(tokenizer, model.config.vocab_size) if config.kv_cache_dtype == "int8"
                       else None)  # an int8 pool's scales come from the model's keys and values over this text
        self._configure_ranks(calibration)  # before the calibration, whose forward passes every rank runs
        try:
            with self.compute_threads():
                worker.initialize_cache(self.num_blocks, calibration)
            worker.make_proposer(config)
            self._attach(worker.init_runner(config.seed))
            with self.compute_threads():
                worker.compile_or_warm_up(self.max_model_len, config.max_num_seqs,
                                          strict_graphs=bool(config.cuda_graphs), patience=self._patience())
        except BaseException:
            worker.shutdown()  # a half-built executor holds no pool (and the ledger counts none)
            raise

    # ------------------------------------------------------------------ what differs with more ranks
    def _configure_ranks(self, calibration: list[int] | None) -> None:
        """Tell the other ranks the plan and the pool's size (none here)."""

    def _attach(self, runner: ModelRunner) -> None:
        """Connect rank 0's runner to the other ranks (none here)."""

    def _patience(self) -> contextlib.AbstractContextManager[object] | None:
        """Around a compile's warm-up: how long rank 0 waits for the other ranks' compilers (none here)."""
        return None

    def compute_threads(self) -> contextlib.AbstractContextManager[None]:
        """Around work every rank does at once: rank 0's share of the CPU's cores (nothing changes here)."""
        return contextlib.nullcontext()

    def step_failed(self, error: Exception) -> BaseException | None:
        """After a step failed with `error`: None when it may be run again, request by request; else what the engine
        dies of (a fault of the device itself: nothing can run again in this process's CUDA context)."""
        return error if is_device_fault(error) else None

    def check_health(self) -> str | None:
        """None while every rank lives; else what happened to the first that did not."""
        return None

    # ------------------------------------------------------------------ steps and the rest
    def execute(self, batch: ScheduledBatch) -> ModelRunnerOutput:
        """One step: inputs, the forward pass the plan chose, sampling (worker/model_runner.py)."""
        return self.worker.execute(batch)

    @property
    def model(self) -> CausalLM:
        return self.worker.model

    @property
    def model_runner(self) -> ModelRunner:
        assert self.worker.model_runner is not None
        return self.worker.model_runner

    @property
    def kv_cache(self) -> PagedKVCache:
        assert self.worker.kv_cache is not None
        return self.worker.kv_cache

    @property
    def proposer(self) -> Proposer | None:
        return self.worker.proposer

    @property
    def profile(self) -> StepProfile:
        return self.model_runner.profile

    def shutdown(self) -> None:
        self.worker.shutdown()


class UniProcExecutor(Executor):
    """One process, one device: vLLM's name for the executor a single-rank engine runs."""
