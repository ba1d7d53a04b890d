"""`Worker`: one rank's device, its model prepared from the plan, its KV pool and its model runner.

The same class runs on every rank, in the order vLLM's workers follow:

    worker = Worker(model, plan)
    worker.load_model()                           # pack, invariant ops, pointwise ops: what the plan says
    num_blocks = worker.determine_num_blocks(...)  # rank 0: the KV budget (kv_budget.py); the others are told
    worker.initialize_cache(num_blocks, ...)      # int8 scales measured, the paged pool allocated
    worker.compile_or_warm_up(max_model_len, ...)  # CUDA graphs captured, the forward compiled, the native step
    output = worker.execute(batch)                # rank 0: inputs, forward, sample (model_runner.py)
    worker.execute_remote(message)                # the other ranks: the same forward, from rank 0's inputs

Rank 0's worker also holds what only it runs: a draft model and the speculative proposer (`make_proposer`).
The worker is what the emulated device's ledger counts (`kv_budget.DeviceLedger`): its pools and its models.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings

import torch
from torch import nn

from ..attention.kv_cache import PagedKVCache, kv_block_bytes
from ..attention.kv_calibration import calibrate_kv_scales
from ..attention.selector import select_backend, unavailable_reason
from ..config import EngineConfig, SpeculativeConfig
from ..core.scheduler import ScheduledBatch
from ..model import CausalLM
from ..model.batch_invariant import make_batch_invariant_
from ..model.packed_linear import pack_linears_
from ..model.pointwise import EAGER_OPS, compiled_ops, pointwise_ops_of, set_pointwise_ops_
from ..sampling import Sampler
from ..spec_decode.draft_model import DraftModelProposer, check_same_vocabulary, load_draft_model
from ..spec_decode.ngram import NgramProposer
from ..spec_decode.proposer import Proposer
from .compiled_forward import CompiledForward
from .cuda_graphs import DecodeGraphs, graph_memory_bytes
from .host_memory import keep_freed_host_memory
from .kv_budget import CPU_DEVICE, check_profile_memory, kv_cache_memory
from .model_runner import ModelRunner, ModelRunnerOutput
from .native_step import DenseWeights, NativeStep
from .plan import ModelPlan
from .step_channel import StepMessage

logger = logging.getLogger(__name__)


class Worker:
    """One rank's model, pool and runner (module docstring). `model` is the whole model, or this rank's shard."""

    def __init__(self, model: CausalLM, plan: ModelPlan) -> None:
        self.model = model
        self.plan = plan
        self.attention_backend = plan.backend(model)
        self.native_weights: DenseWeights | None = None
        self.draft_model: CausalLM | None = None
        self.kv_cache: PagedKVCache | None = None
        self.proposer: Proposer | None = None
        self.model_runner: ModelRunner | None = None

    # ------------------------------------------------------------------ set-up, in order
    def load_model(self) -> None:
        """Prepare the model in place as the plan says: packed linears (before the KV budget, which counts the
        weights), the plain weights a dense native step reads, batch-invariant ops, the pointwise parts."""
        plan, model = self.plan, self.model
        if plan.prepack_weights:
            packed = pack_linears_(model)
            if packed:
                logger.info("packed %d linear layers for oneDNN, in place", len(packed))
        self.native_weights = DenseWeights(model) if plan.native_dense_weights else None  # counted in the budget too
        if plan.batch_invariant:
            make_batch_invariant_(model, triton=plan.invariant_triton)
        compiled = pointwise_ops_of(model).name == "compiled"
        if plan.pointwise_ops == "compiled" and not compiled:
            count = set_pointwise_ops_(model, compiled_ops())
            logger.info("compiled the pointwise ops of %d modules", count)
        elif plan.pointwise_ops == "eager" and compiled:
            set_pointwise_ops_(model, EAGER_OPS)  # asked for eager: a model compiled by an earlier engine too
        if plan.keep_freed_host_memory:
            keep_freed_host_memory()  # a step's temporaries reuse memory instead of page-faulting (host_memory.py)

    def load_draft_model(self, spec: SpeculativeConfig | None, draft_model: CausalLM | None) -> None:
        """The draft model of a "draft" speculative config: the one given, or the one the config names, loaded on
        the target's device (its weights and its pool count in the budget too)."""
        if spec is None or spec.method != "draft":
            if draft_model is not None:
                raise ValueError('a draft_model is for speculative_config={"method": "draft", ...}')
            return
        if draft_model is None:
            draft_model = load_draft_model(spec, self.model)
        else:
            check_same_vocabulary(draft_model, self.model)
        self.draft_model = draft_model

    def block_bytes(self) -> int:
        """Bytes one block of the KV pool takes, with the same block of the draft model's pool where there is one."""
        model, plan = self.model, self.plan
        nbytes = kv_block_bytes(model.config, plan.block_size, model.dtype, plan.kv_cache_dtype)
        if self.draft_model is not None:
            nbytes += kv_block_bytes(self.draft_model.config, plan.block_size, self.draft_model.dtype)
        return nbytes

    def determine_num_blocks(self, config: EngineConfig, max_model_len: int) -> int:
        """The pool size: num_kv_blocks, else kv_cache_memory, else what the device has left (kv_budget.py), less
        the room CUDA graphs will take. With a draft model, a block's bytes include the draft pool's block (both
        pools get this many blocks). Where the CPU plays a GPU, that GPU's memory must hold the pool too."""
        model, block = self.model, self.block_bytes()
        if config.num_kv_blocks is not None:
            num_blocks = config.num_kv_blocks
        else:
            if config.kv_cache_memory is not None:
                nbytes = config.kv_cache_memory
            else:
                reserve = graph_memory_bytes(model.config, self.attention_backend, max_num_seqs=config.max_num_seqs,
                                             max_model_len=max_model_len, dtype=model.dtype,
                                             block_size=config.block_size) if self.plan.cuda_graphs else 0
                nbytes = kv_cache_memory(model, config, max_model_len, reserve=reserve, block_bytes=block,
                                         others=self.device_models[1:])
            num_blocks = nbytes // block
            if num_blocks < 1:
                raise ValueError(f"{nbytes} bytes of KV memory hold no block of {config.block_size} tokens "
                                 f"({block} bytes each)")
        check_profile_memory(model, config, num_blocks * block, others=self.device_models[1:])
        return num_blocks

    def initialize_cache(self, num_blocks: int, calibration: list[int] | None) -> None:
        """The pool of `num_blocks` blocks; an int8 pool's scales first, from the model's keys (turned back by the
        rotary embedding) and values over the calibration text's token ids (attention/kv_calibration.py).
        Sharded, every rank measures its own heads, at once (the forward passes' collectives meet)."""
        model, plan = self.model, self.plan
        scales = None
        if calibration is not None:
            started = time.perf_counter()
            scales = calibrate_kv_scales(model, calibration)
            logger.info("int8 KV cache: scales from %d tokens in %.2f s", len(calibration), time.perf_counter() - started)
        self.kv_cache = PagedKVCache.for_model(model.config, num_blocks, plan.block_size, dtype=model.dtype,
                                               device=model.device, kv_cache_dtype=plan.kv_cache_dtype, kv_scales=scales)
        CPU_DEVICE.register(self)  # the emulated device's book of what live workers hold (kv_budget.py)

    def make_proposer(self, config: EngineConfig) -> None:
        """The speculative proposer the config asks for (spec_decode/), or none: one token per step. A draft
        model's pool has as many blocks as the target's, of the same size (`block_bytes` counted both)."""
        spec = config.speculative_config
        if spec is None:
            return
        if self.draft_model is None:
            self.proposer = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_max, spec.prompt_lookup_min)
            return
        assert self.kv_cache is not None
        draft, block_size = self.draft_model, self.plan.block_size
        # The target's backend where it runs the draft too (another dtype may rule it out), else the draft's "auto".
        name = self.attention_backend.name
        if unavailable_reason(name, draft.device, draft.dtype, block_size) is not None:
            name = "auto"
        backend = select_backend(name, draft.device, draft.dtype, None, block_size)
        self.proposer = DraftModelProposer(draft, spec.num_speculative_tokens, num_blocks=self.kv_cache.num_blocks,
                                           block_size=block_size, attention_backend=backend,
                                           max_tokens_per_pass=config.max_num_batched_tokens, seed=config.seed)

    def init_runner(self, seed: int | None = None) -> ModelRunner:
        assert self.kv_cache is not None, "initialize_cache first"
        self.model_runner = ModelRunner(self.model, Sampler(seed=seed, device=self.model.device), self.kv_cache,
                                        attention_backend=self.attention_backend)
        return self.model_runner

    def compile_or_warm_up(self, max_model_len: int, max_num_seqs: int, *, strict_graphs: bool = False,
                           patience: contextlib.AbstractContextManager[object] | None = None) -> None:
        """What the plan compiles, after the pool exists (graphs and the compiled graph read and write it): decode
        steps captured in CUDA graphs (a failed capture leaves every step eager with a warning, unless
        `strict_graphs`: the config asked for them), the forward pass compiled now rather than in the first
        request's step (`patience`: around the warm-up, whose collectives meet the other ranks' compilers), the
        native step."""
        runner, plan = self.model_runner, self.plan
        assert runner is not None and self.kv_cache is not None, "init_runner first"
        if plan.cuda_graphs:
            graphs = DecodeGraphs(self.model, self.kv_cache, self.attention_backend, max_num_seqs=max_num_seqs,
                                  max_model_len=max_model_len)
            try:
                runner.capture_graphs(graphs)
            except Exception as error:
                graphs.close()
                if strict_graphs:
                    raise
                warnings.warn(f"capturing decode steps in CUDA graphs failed ({type(error).__name__}: {error}); "
                              f"every step runs eagerly (cuda_graphs=False silences this)", RuntimeWarning,
                              stacklevel=4)
        if plan.compile_model:
            set_pointwise_ops_(self.model, EAGER_OPS)  # inside the graph the pointwise parts are plain functions
            compiled = CompiledForward(self.model, self.kv_cache, self.attention_backend)
            started = time.perf_counter()
            with patience if patience is not None else contextlib.nullcontext():
                compiled.warm_up()
            logger.info("compiled the forward pass in %.1f s", time.perf_counter() - started)
            runner.compiled = compiled
        if plan.native_step:
            runner.native = NativeStep(self.model, self.kv_cache, max_model_len, self.native_weights)

    # ------------------------------------------------------------------ steps
    def execute(self, batch: ScheduledBatch) -> ModelRunnerOutput:
        assert self.model_runner is not None
        return self.model_runner.run(batch)

    def execute_remote(self, message: StepMessage) -> None:
        """A worker rank's part of rank 0's step: the same forward pass over the inputs rank 0 sent."""
        assert self.model_runner is not None
        self.model_runner.run_remote(message)

    # ------------------------------------------------------------------ what the worker holds
    @property
    def kv_pool_bytes(self) -> int:
        """The bytes of every KV pool this worker holds: its own and its draft model's."""
        draft = self.proposer.nbytes if isinstance(self.proposer, DraftModelProposer) else 0
        return (self.kv_cache.nbytes if self.kv_cache is not None else 0) + draft

    @property
    def device_models(self) -> list[nn.Module]:
        """What holds the weights this worker keeps on its device: the model, a draft model, and the plain weights
        a native step reads where the model's are packed (shared ones count once: kv_budget.py)."""
        return ([self.model] + ([self.draft_model] if self.draft_model is not None else [])
                + ([self.native_weights] if self.native_weights is not None else []))

    @property
    def device(self) -> torch.device:
        return self.model.device

    def shutdown(self) -> None:
        """Give the pool's memory back (on CUDA, to the driver too); graphs, the native step and a draft model's
        pool with it. Calling it twice is harmless."""
        runner = self.model_runner
        if runner is not None:
            if runner.graphs is not None:
                runner.graphs.close()  # they point into the pool
                runner.graphs = None
            runner.native = None  # it holds the pool and the weights it points at
        self.native_weights = None
        if self.kv_cache is not None:
            self.kv_cache.release()
        if isinstance(self.proposer, DraftModelProposer):
            self.proposer.release()
        CPU_DEVICE.release(self)
        if self.model.device.type == "cuda":
            torch.cuda.empty_cache()
