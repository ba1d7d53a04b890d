"""`LLMEngine`: requests in, one step at a time, outputs out (vLLM's layer under `LLM`).

    engine.add_request("a", "Hello", SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for output in engine.step():       # schedule -> run -> postprocess
            print(output.request_id, output.outputs[0].text_delta)

Bad input is refused in `add_request` (by the `InputProcessor`) with an `InvalidRequestError`, a
ValueError naming the field, before anything enters the engine, so the requests already running
are never disturbed by it. That includes a prompt that could never be scheduled.

If a step still fails (a bug, a fault in one request's data), the engine retries the step one
request at a time: the requests whose step fails again finish with `finish_reason="error"` and
free their blocks; every other request goes on with exactly the tokens it would have had.

The engine owns the KV pool (`PagedKVCache`) and its bookkeeping (`BlockManager`); `stats()`
reports both, with the scheduler's preemption and prefix-cache counters.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..attention.kv_calibration import calibrate_kv_scales, calibration_token_ids
from ..attention.kv_cache import PagedKVCache, kv_block_bytes
from ..attention.kv_quant import KVScales
from ..attention.selector import select_backend, unavailable_reason
from ..config import EngineConfig
from ..distributed.sharding import shard_model_, tensor_parallel_unsupported_reason
from ..kv_transfer.payload import KVLayout, KVPayload, read_blocks, write_blocks
from ..distributed.launch import torch_threads
from ..distributed.workers import ShardSettings, ShardWorkers, WorkerSpec, start_shard_workers
from ..errors import EngineDeadError, InvalidRequestError, SamplingError, is_device_fault
from ..device import device_profile, resolve_device
from ..model import CausalLM, load_model
from ..model.pointwise import EAGER_OPS, compiled_ops, pointwise_ops_of, set_pointwise_ops_
from ..model.batch_invariant import batch_invariant_unsupported_reason, make_batch_invariant_
from ..model.packed_linear import is_packed, pack_linears_, packing_unsupported_reason
from ..model.tokenizer import Tokenizer
from ..sampling import Sampler, SamplingParams
from .block_manager import BlockManager
from ..spec_decode.draft_model import DraftModelProposer, check_same_vocabulary, load_draft_model
from ..spec_decode.ngram import NgramProposer
from ..spec_decode.proposer import Proposer
from ..spec_decode.stats import SpeculationStats
from ..structured_output import GrammarState
from .compiled_forward import CompiledForward, compiled_forward_unavailable_reason
from .native_step import DenseWeights, NativeStep, native_step_unavailable_reason, uses_dense_weights
from .cuda_graphs import DecodeGraphs, graph_memory_bytes, graphs_unavailable_reason
from .host_memory import keep_freed_host_memory
from .input_processor import EngineRequest, InputProcessor, Messages, Prompt
from .kv_budget import CPU_DEVICE, check_profile_memory, kv_cache_memory
from .model_runner import ModelRunner, ModelRunnerOutput, StepProfile
from .output_processor import OutputProcessor, RequestState
from .outputs import RequestOutput
from .scheduler import ScheduledBatch, Scheduler, StepRecord
from .sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)

__all__ = ["EngineRequest", "EngineStats", "LLMEngine", "Messages", "Prompt"]


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's memory and queues (lessons, tests, benchmarks and the server read it)."""

    num_total_blocks: int
    num_free_blocks: int  # never used or cached-but-unreferenced (evictable)
    num_cached_blocks: int  # blocks named in the prefix cache, held or not
    block_size: int
    num_running: int
    num_waiting: int  # sequences: waiting to start or to run again, and forks yet to be made
    num_preemptions: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    num_failed_requests: int = 0  # requests a failed step finished with an error
    num_waiting_requests: int = 0  # requests none of whose sequences runs (what a server's back-pressure counts)
    attention_backend: str = ""  # the attention backend's name (lesson 11)
    # How the engine set the model up when it was built (a later engine on the same model may set it up again):
    prepacked_weights: bool = False  # the model's linear layers run on oneDNN-packed weights (prepack_weights)
    pointwise_ops: str = "eager"  # "compiled" when the layers' pointwise parts run through torch.compile
    cuda_graph_sizes: tuple[int, ...] = ()  # the batch sizes captured as CUDA graphs (none: every step eager)
    compiled_model: bool = False  # steps whose attention allows it run as one compiled graph (compile_model)
    num_compiled_steps: int = 0  # steps that ran as the compiled graph
    native_step: bool = False  # steps of a few tokens run as one native call (native_step)
    num_native_steps: int = 0  # steps that ran as the native call
    num_graph_replays: int = 0  # decode steps that ran from a CUDA graph
    # Speculative decoding (lesson 14): drafts verified, drafts kept, and [a]: verifications that kept a drafts.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_length_counts: tuple[int, ...] = ()
    # Jump-forward (lesson 15): tokens a grammar forced, verified as drafts, and how many of them the model kept.
    num_forced_tokens: int = 0
    num_accepted_forced_tokens: int = 0

    @property
    def num_used_blocks(self) -> int:
        return self.num_total_blocks - self.num_free_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        queried = self.prefix_cache_queried_tokens
        return self.prefix_cache_hit_tokens / queried if queried else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Kept drafts over verified drafts (0 without speculation)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a sequence gained per verification: the drafts it kept and the one drawn after them."""
        verifications = sum(self.accepted_length_counts)
        return 1 + self.num_accepted_tokens / verifications if verifications else 0.0


class LLMEngine:
    """Holds the KV pool, the scheduler, the model runner and every live request."""

    def __init__(self, model: CausalLM, tokenizer: Tokenizer | None, config: EngineConfig | None = None, *,
                 owns_model: bool = False, draft_model: CausalLM | None = None,
                 workers: ShardWorkers | None = None) -> None:
        """`owns_model`: the caller loaded `model` for this engine alone (`LLM(...)`, `serve`), so the engine
        may change it in place (`prepack_weights`); a model passed in from outside is left as it is unless
        the config asks. `draft_model`: an already loaded draft for a "draft" `speculative_config` (else the
        engine loads the one the config names). `workers`: the other ranks of a tensor_parallel_size > 1 engine,
        when `model` is already rank 0's shard of their group (LLM(...) starts them; else the engine does)."""
        self.workers: ShardWorkers | None = workers
        try:
            self._set_up(model, tokenizer, config, owns_model, draft_model)
        except BaseException:
            if self.workers is not None:  # given or started: a half-built engine leaves no worker behind
                self.workers.close()
            raise

    def _set_up(self, model: CausalLM, tokenizer: Tokenizer | None, config: EngineConfig | None,
                owns_model: bool, draft_model: CausalLM | None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.native_weights: DenseWeights | None = None
        self.config = config = config or EngineConfig()
        limit = model.config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(f"max_model_len {config.max_model_len} is beyond the model's {limit} positions")
        # Without chunked prefill a whole prompt (after a preemption: prompt + output) must fit in one step.
        step_limit = None if config.enable_chunked_prefill else config.max_num_batched_tokens + 1
        if config.max_model_len is not None and step_limit is not None and config.max_model_len > step_limit:
            raise ValueError(f"max_model_len {config.max_model_len} cannot be scheduled with enable_chunked_prefill="
                             f"False and max_num_batched_tokens={config.max_num_batched_tokens}: a sequence must "
                             f"fit in one step (max_model_len <= max_num_batched_tokens + 1)")
        block_size = config.block_size
        # The environment variable is read here, once per engine: a user's or a lesson's override of "auto".
        self.attention_backend = select_backend(config.attention_backend, model.device, model.dtype, os.environ,
                                                  block_size, batch_invariant=config.batch_invariant)
        logger.info("attention backend: %s", self.attention_backend.name)
        # Batch invariance runs Triton kernels throughout where attention does (CUDA; the CPU's interpreter).
        self._invariant_triton = config.batch_invariant and self.attention_backend.name == "triton"
        self.workers = self._tensor_parallel_workers(self.workers)  # before packing: the model is sharded first
        if config.batch_invariant:
            reason = batch_invariant_unsupported_reason(model, triton=self._invariant_triton)
            if reason is not None:
                raise ValueError(reason)
        # Before packing: a native step over dense layers reads plain weights (native_step.DenseWeights).
        wants_native = self._wants_native_step()
        dense_native = wants_native and uses_dense_weights(model)
        self._pack_linears(owns_model, native=dense_native)  # before the KV budget, which counts the weights
        self.native_weights = DenseWeights(model) if dense_native else None  # counted in the budget too
        if config.batch_invariant:
            make_batch_invariant_(model, triton=self._invariant_triton)
        self._compile_pointwise(owns_model)
        self.draft_model = self._draft_model(draft_model)  # its weights and its KV pool count in the budget too
        if model.device.type == "cpu":
            keep_freed_host_memory()  # a step's temporaries reuse memory instead of page-faulting (host_memory.py)
        wants_graphs = self._wants_graphs()
        num_blocks = self._num_kv_blocks(config.max_model_len or limit, graphs=wants_graphs)
        if config.max_model_len is not None and config.max_model_len > num_blocks * block_size:
            raise ValueError(
                f"max_model_len {config.max_model_len} needs more KV memory than the pool's {num_blocks} "
                f"blocks of {block_size} tokens; lower max_model_len or give the engine more KV memory "
                f"(num_kv_blocks, kv_cache_memory or gpu_memory_utilization)"
            )
        context_len = min(config.max_model_len or limit, step_limit or limit)
        # Unless asked for, a context longer than the whole pool is not offered.
        self.max_model_len = min(context_len, num_blocks * block_size)
        calibration = (calibration_token_ids(tokenizer, model.config.vocab_size) if config.kv_cache_dtype == "int8"
                       else None)  # an int8 pool's scales come from the model's keys and values over this text
        wants_compiled = self._wants_compiled_forward(owns_model)
        if self.workers is not None:  # before the calibration, whose forward passes every rank runs
            self.workers.configure(ShardSettings(num_blocks, block_size, config.kv_cache_dtype,
                                                 self.attention_backend.name, is_packed(model),
                                                 pointwise_ops_of(model).name == "compiled", wants_compiled,
                                                 None if calibration is None else tuple(calibration)))
        with self._compute_threads():
            scales = self._calibrate_kv_scales(calibration)
        self.kv_cache = PagedKVCache.for_model(model.config, num_blocks, block_size, dtype=model.dtype,
                                               device=model.device, kv_cache_dtype=config.kv_cache_dtype,
                                               kv_scales=scales)
        self.proposer = self._make_proposer(num_blocks)
        CPU_DEVICE.register(self)  # the emulated device's book of what live engines hold (kv_budget.py)
        self.is_shut_down = False
        self.block_manager = BlockManager(num_blocks, block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager)
        self.profile = StepProfile()  # where step time goes (lesson 09, bench)
        self.model_runner = ModelRunner(model, Sampler(seed=config.seed, device=model.device), self.kv_cache,
                                        self.profile, self.attention_backend)
        if self.workers is not None:
            self.model_runner.channel = self.workers.channel
        if wants_graphs:
            self._capture_graphs()
        if wants_compiled:
            with self._compute_threads():
                self._compile_forward()
        if wants_native:
            self.model_runner.native = NativeStep(model, self.kv_cache, self.max_model_len, self.native_weights)
        self.input_processor = InputProcessor(tokenizer, model.config, config, context_len=context_len,
                                              max_model_len=self.max_model_len, num_kv_blocks=num_blocks)
        self.output_processor = OutputProcessor(tokenizer)
        self.step_records: list[StepRecord] = []  # every step's, with `record_steps`
        self.last_step: StepRecord | None = None  # the latest step's, always (the server's live feed reads it)
        spec = config.speculative_config
        self.spec_stats = SpeculationStats(spec.num_speculative_tokens) if spec is not None else None
        self.num_failed_requests = 0
        self.num_forced_tokens = self.num_accepted_forced_tokens = 0
        self._forced: set[Sequence] = set()  # this step's sequences whose drafts are the tokens their grammar forces
        self._unspeculated: set[Sequence] = set()  # sequences whose proposals failed: they decode one token a step
        self.dead_reason: BaseException | None = None  # the device fault that killed the engine, if one did
        self._kv_layout: KVLayout | None = None  # what this pool's blocks mean (KV transfer), once asked
        self._num_steps = 0
        self._num_idle_steps = 0  # consecutive steps that scheduled nothing while requests were left
        # How the model was set up for this engine, read once: finding out walks every module (0.3 ms for the
        # bundled model), and a server's loop takes stats() two or three times a step.
        self._prepacked_weights, self._pointwise_ops = is_packed(model), pointwise_ops_of(model).name

    @classmethod
    def from_pretrained(cls, model: str | Path | None = None, *, device: str | torch.device = "auto",
                        dtype: str | torch.dtype = "auto", quantization: str | None = None,
                        config: EngineConfig | None = None) -> "LLMEngine":
        """An engine with a model of its own, loaded by `load_model` (`owns_model`): with tensor_parallel_size > 1,
        the workers are started first and every rank, this one included, reads only its own shard."""
        config = config or EngineConfig()
        workers = None
        if config.tensor_parallel_size > 1:
            _check_tensor_parallel_budget(config, torch.device(resolve_device(device)))
            workers = start_shard_workers(model, config.tensor_parallel_size, device=device, dtype=dtype,
                                          quantization=quantization, timeout_s=config.tensor_parallel_timeout_s)
        try:
            loaded, tokenizer = load_model(model, device=device, dtype=dtype, quantization=quantization,
                                           tensor_parallel=workers.tp if workers is not None else None)
            return cls(loaded, tokenizer, config, owns_model=True, workers=workers)
        except BaseException:
            if workers is not None:
                workers.close()
            raise

    def _compute_threads(self) -> contextlib.AbstractContextManager[None]:
        """Around work every rank does at once: rank 0's share of the CPU's cores (the workers compute beside it),
        for that work only (distributed/launch.py's torch_threads); nothing changes for a single rank."""
        return torch_threads(self.workers.num_threads if self.workers is not None else None)

    def _tensor_parallel_workers(self, workers: ShardWorkers | None) -> ShardWorkers | None:
        """The other ranks of a tensor_parallel_size > 1 engine: the ones given (LLM(...) started them and loaded
        this rank's shard), else started here from the model's name, this rank's shard cut from the model given
        (in place: it becomes rank 0's shard)."""
        size, model = self.config.tensor_parallel_size, self.model
        if size == 1:
            if workers is not None:
                raise ValueError("workers are for tensor_parallel_size > 1")
            return None
        if workers is None:
            reason = tensor_parallel_unsupported_reason(model.config, size)
            if reason is not None:
                raise ValueError(reason)
            if model.source is None:
                raise ValueError("tensor_parallel_size > 1 starts workers that load the model by its name, and "
                                 "this model has none: load it with load_model(...) or LLM(...)")
            if model.tp is not None:
                raise ValueError("this model is already a shard: pass the workers that hold the other shards")
            _check_tensor_parallel_budget(self.config, model.device)
            spec = WorkerSpec(model.source or None, model.device.type, str(model.dtype).removeprefix("torch."),
                              timeout_s=self.config.tensor_parallel_timeout_s)
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

    def _pack_linears(self, owns_model: bool, native: bool = False) -> None:
        """Repack the model's linear weights for oneDNN, in place: when the config says True, or says None
        (the default) and the engine owns the model and packing applies here, unless `native` (a native step
        over dense layers, which reads the plain weights: packed, it would need a plain copy of each)."""
        wanted = self.config.prepack_weights
        reason = packing_unsupported_reason(self.model)
        if self._invariant_triton:  # the invariant Triton matrix multiply replaces the model's nn.Linear modules
            if wanted:
                raise ValueError("prepack_weights=True, but batch_invariant=True with Triton attention multiplies "
                                 "by Triton kernels, not packed weights")
            return
        if wanted is None:
            wanted = (owns_model or self.config.batch_invariant) and reason is None and not native
        if not wanted:
            return
        if reason is not None:
            raise ValueError(f"prepack_weights=True, but {reason}")
        packed = pack_linears_(self.model)
        if packed:
            logger.info("packed %d linear layers for oneDNN, in place", len(packed))

    def _compile_pointwise(self, owns_model: bool) -> None:
        """The layers' pointwise parts through torch.compile (model/pointwise.py): when the config says True,
        or says None and the engine owns the model on CUDA (on the CPU it measured no faster); never with
        enforce_eager."""
        wanted = self.config.compile_pointwise
        eager = self.config.enforce_eager or self.config.batch_invariant
        if wanted is None:
            wanted = owns_model and self.model.device.type == "cuda" and not eager
        compiled = pointwise_ops_of(self.model).name == "compiled"
        if wanted and not compiled:
            count = set_pointwise_ops_(self.model, compiled_ops())
            logger.info("compiled the pointwise ops of %d modules", count)
        elif compiled and (eager or self.config.compile_pointwise is False):
            set_pointwise_ops_(self.model, EAGER_OPS)  # asked for eager: a model compiled by an earlier engine too

    def _draft_model(self, draft_model: CausalLM | None) -> CausalLM | None:
        """The draft model of a "draft" `speculative_config`: the one given, or the one the config names, loaded
        on the target's device; None for any other config."""
        spec = self.config.speculative_config
        if spec is None or spec.method != "draft":
            if draft_model is not None:
                raise ValueError('a draft_model is for speculative_config={"method": "draft", ...}')
            return None
        if draft_model is None:
            return load_draft_model(spec, self.model)
        check_same_vocabulary(draft_model, self.model)
        return draft_model

    def _make_proposer(self, num_blocks: int) -> Proposer | None:
        """The speculative proposer the config asks for (spec_decode/), or None: one token per step. A draft
        model's pool has as many blocks as the engine's, of the same size (`_block_bytes` counted both)."""
        spec = self.config.speculative_config
        if spec is None:
            return None
        if self.draft_model is None:
            return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_max, spec.prompt_lookup_min)
        draft, block_size = self.draft_model, self.config.block_size
        # The target's backend where it runs the draft too (another dtype may rule it out), else the draft's "auto".
        name = self.attention_backend.name
        if unavailable_reason(name, draft.device, draft.dtype, block_size) is not None:
            name = "auto"
        backend = select_backend(name, draft.device, draft.dtype, None, block_size)
        return DraftModelProposer(draft, spec.num_speculative_tokens, num_blocks=num_blocks, block_size=block_size,
                                  attention_backend=backend, max_tokens_per_pass=self.config.max_num_batched_tokens,
                                  seed=self.config.seed)

    def _block_bytes(self) -> int:
        """Bytes one block of the KV pool takes, with the same block of the draft model's pool where there is one."""
        model, config = self.model, self.config
        nbytes = kv_block_bytes(model.config, config.block_size, model.dtype, config.kv_cache_dtype)
        if self.draft_model is not None:
            nbytes += kv_block_bytes(self.draft_model.config, config.block_size, self.draft_model.dtype)
        return nbytes

    @property
    def kv_pool_bytes(self) -> int:
        """The bytes of every KV pool this engine holds: its own and its draft model's."""
        draft = self.proposer.nbytes if isinstance(self.proposer, DraftModelProposer) else 0
        return self.kv_cache.nbytes + draft

    @property
    def device_models(self) -> list[nn.Module]:
        """What holds the weights this engine keeps on its device: the target, a draft model, and the plain
        weights a native step reads where the target's are packed (shared ones count once: kv_budget.py)."""
        return ([self.model] + ([self.draft_model] if self.draft_model is not None else [])
                + ([self.native_weights] if self.native_weights is not None else []))

    def _wants_compiled_forward(self, owns_model: bool) -> bool:
        """Whether steps run as one compiled forward pass (compiled_forward.py): when the config says True, or
        says None and the engine owns a CPU model whose attention backend allows it; never with enforce_eager.
        With tensor_parallel_size > 1 only when it says True: every rank compiles its own graph, at once (on a
        small CPU the ranks' compilers share its cores for minutes). Not by itself on a CPU playing a GPU
        (LLM_RUNTIME_DEVICE_PROFILE): the GPU would not compile the forward pass this way, and the compile
        costs 10-20 s an engine that the played run would spend on nothing the GPU does."""
        if self.config.batch_invariant:
            return False  # the config refuses compile_model=True with it
        wanted = self.config.compile_model
        if wanted is None and self.config.tensor_parallel_size > 1:
            return False
        reason = compiled_forward_unavailable_reason(self.attention_backend, self.config.kv_cache_dtype)
        if wanted is None:
            return (owns_model and self.model.device.type == "cpu" and not device_profile(self.model.device).is_gpu
                    and reason is None and not self.config.enforce_eager and self.config.compile_pointwise is not True)
        if wanted and reason is not None:
            raise ValueError(f"compile_model=True, but {reason}")
        return wanted

    def _wants_native_step(self) -> bool:
        """Whether short steps run as one native call (native_step.py): when the config says True (or None, and
        the model and pool are ones it covers); never with enforce_eager, batch invariance or tensor parallelism."""
        wanted = self.config.native_step
        if wanted is False or self.config.enforce_eager or self.config.batch_invariant:
            return False
        if self.config.tensor_parallel_size > 1:
            return False  # the config refuses native_step=True with it
        reason = native_step_unavailable_reason(self.model, self.config.kv_cache_dtype)
        if wanted and reason is not None:
            raise ValueError(f"native_step=True, but {reason}")
        return reason is None

    def _compile_forward(self) -> None:
        """Compile the forward pass now (warm_up), not in the first request's step. The layers' pointwise parts
        run as plain functions inside it (the graph fuses them)."""
        set_pointwise_ops_(self.model, EAGER_OPS)
        compiled = CompiledForward(self.model, self.kv_cache, self.attention_backend)
        started = time.perf_counter()
        # The warm-up's collectives meet the workers' (workers.py), whose compilers finish when they do.
        with self.workers.tp.patient() if self.workers is not None else contextlib.nullcontext():
            compiled.warm_up()
        logger.info("compiled the forward pass in %.1f s", time.perf_counter() - started)
        self.model_runner.compiled = compiled

    def _wants_graphs(self) -> bool:
        """Whether decode steps will be captured in CUDA graphs (cuda_graphs.py): when the config says True,
        or says None and this device and attention backend allow it; never with enforce_eager."""
        if self.config.batch_invariant or self.config.tensor_parallel_size > 1:
            return False  # the config refuses cuda_graphs=True with either (not yet run on a GPU that way)
        wanted = self.config.cuda_graphs
        reason = graphs_unavailable_reason(self.model.device, self.attention_backend)
        if reason is None and self.config.kv_cache_dtype != "auto":
            reason = "a quantized KV cache is read through a copy of each step's blocks, chosen on the host"
        if wanted is None:
            return reason is None and not self.config.enforce_eager
        if wanted and reason is not None:
            raise ValueError(f"cuda_graphs=True, but {reason}")
        return wanted

    def _capture_graphs(self) -> None:
        """Capture decode steps, after the pool exists (the graphs read and write it). When the config left
        the choice to the engine (None), a failed capture leaves every step eager, with a warning."""
        graphs = DecodeGraphs(self.model, self.kv_cache, self.attention_backend,
                              max_num_seqs=self.config.max_num_seqs, max_model_len=self.max_model_len)
        try:
            self.model_runner.capture_graphs(graphs)
        except Exception as error:
            graphs.close()
            if self.config.cuda_graphs:
                raise
            warnings.warn(f"capturing decode steps in CUDA graphs failed ({type(error).__name__}: {error}); "
                          f"every step runs eagerly (cuda_graphs=False silences this)", RuntimeWarning,
                          stacklevel=3)

    def _calibrate_kv_scales(self, token_ids: list[int] | None) -> KVScales | None:
        """An int8 pool's scales, from the model's keys (turned back by the rotary embedding) and values over
        the calibration text's `token_ids` (attention/kv_calibration.py): the same for every pool size and
        context. None for any other pool (no token ids). Sharded, each rank measures its own heads."""
        if token_ids is None:
            return None
        started = time.perf_counter()
        scales = calibrate_kv_scales(self.model, token_ids)
        logger.info("int8 KV cache: scales from %d tokens in %.2f s", len(token_ids), time.perf_counter() - started)
        return scales

    def _num_kv_blocks(self, max_model_len: int, graphs: bool) -> int:
        """The pool size: num_kv_blocks, else kv_cache_memory, else what the device has left (kv_budget.py),
        less the room CUDA graphs will take when `graphs`. With a draft model, a block's bytes include the draft
        pool's block (both pools get this many blocks). Where the CPU plays a GPU, that GPU's memory must hold
        the pool too (kv_budget.check_profile_memory)."""
        config, model = self.config, self.model
        block = self._block_bytes()
        if config.num_kv_blocks is not None:
            num_blocks = config.num_kv_blocks
        else:
            if config.kv_cache_memory is not None:
                nbytes = config.kv_cache_memory
            else:
                reserve = graph_memory_bytes(model.config, self.attention_backend, max_num_seqs=config.max_num_seqs,
                                             max_model_len=max_model_len, dtype=model.dtype,
                                             block_size=config.block_size) if graphs else 0
                nbytes = kv_cache_memory(model, config, max_model_len, reserve=reserve, block_bytes=block,
                                         others=self.device_models[1:])
            num_blocks = nbytes // block
            if num_blocks < 1:
                raise ValueError(f"{nbytes} bytes of KV memory hold no block of {config.block_size} tokens "
                                 f"({block} bytes each)")
        check_profile_memory(model, config, num_blocks * block, others=self.device_models[1:])
        return num_blocks

    def shutdown(self) -> None:
        """Abort every live request and give the KV pool's memory back (on CUDA, to the driver too).
        The engine refuses new requests afterwards. Calling it twice is harmless."""
        if self.is_shut_down:
            return
        for request_id in list(self.requests):
            self.abort_request(request_id)
        self.is_shut_down = True
        self.input_processor.close()
        if self.model_runner.graphs is not None:
            self.model_runner.graphs.close()  # they point into the pool
            self.model_runner.graphs = None
        self.model_runner.native = self.native_weights = None  # it holds the pool and the weights it points at
        self.kv_cache.release()
        if self.workers is not None:
            self.workers.close()
        if isinstance(self.proposer, DraftModelProposer):
            self.proposer.release()
        CPU_DEVICE.release(self)
        if self.model.device.type == "cuda":
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------ requests
    @property
    def requests(self) -> dict[str, RequestState]:
        """The live requests by id (those added and not yet finished or aborted)."""
        return self.output_processor.requests

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        """Validate and enqueue a request; raises InvalidRequestError (and changes nothing) on bad input."""
        self.add_processed(self.input_processor.process(request_id, prompt, params, arrival_time))

    def add_processed(self, request: EngineRequest) -> None:
        """Enqueue a request the input processor made (the async engine validates off the event loop,
        then adds the request between steps)."""
        if self.is_shut_down:
            raise EngineDeadError("the engine was shut down; create a new one")
        if self.dead_reason is not None:
            raise EngineDeadError(f"the engine's device failed; create a new engine: {self.dead_reason!r}")
        if request.request_id in self.requests:
            raise InvalidRequestError("request_id", f"request id {request.request_id!r} is already in use")
        if request.pending_grammar is not None:
            raise ValueError("the request's grammar is still compiling: add request.compiled() (or await "
                             "request.compiled_async())")
        params = request.params
        sequences = []
        for index in range(params.n):
            seq_params = params.for_completion(index)  # completion i of a seeded request uses seed + i
            sequences.append(Sequence(
                request.request_id, request.prompt_token_ids, seq_params, max_new_tokens=request.max_new_tokens,
                eos_token_ids=self.model.config.eos_token_ids, index=index, arrival_time=request.arrival_time,
                generator=seq_params.make_generator(),
                grammar=GrammarState(request.grammar) if request.grammar is not None else None))
        # All or nothing: a request the scheduler refuses leaves no output state behind.
        self.output_processor.add_request(request, sequences)
        try:
            self.scheduler.add(sequences[0], sequences[1:])
        except BaseException:
            self.output_processor.abort_request(request.request_id)
            raise

    def abort_request(self, request_id: str) -> None:
        """Stop a request now; its sequences finish with reason "abort" and free their caches."""
        if request_id not in self.requests:
            raise ValueError(f"unknown request id {request_id!r} (never added, or already finished)")
        self.scheduler.abort(request_id)
        self.output_processor.abort_request(request_id)
        if self.proposer is not None:
            self.proposer.keep_only(set(self.scheduler.running))

    # ------------------------------------------------------------------ KV transfer (lesson 18)
    @property
    def kv_layout(self) -> KVLayout:
        """What this engine's pool blocks mean (kv_transfer/payload.py): a payload of another layout is refused."""
        if self._kv_layout is None:
            self._kv_layout = KVLayout.of(self.model, self.kv_cache)
        return self._kv_layout

    def check_kv_transfer(self) -> None:
        """ValueError unless this engine can ship and receive KV blocks."""
        if self.config.tensor_parallel_size > 1:
            raise ValueError("KV transfer ships one pool's blocks; a tensor-parallel engine's are split over its "
                             "ranks (not yet shipped)")
        if not self.config.enable_prefix_caching:
            raise ValueError("KV transfer goes through the prefix cache: enable_prefix_caching must be True")

    def export_prefix(self, token_ids: list[int], transfer_id: str) -> KVPayload:
        """The KV of the leading whole blocks of `token_ids` that this engine's prefix cache holds now (a prompt
        this engine computed: every whole block before its last token), read from the pool as stored, to ship
        to the engine that will decode it."""
        self.check_kv_transfer()
        block_size = self.config.block_size
        hits = self.block_manager.allocator.prefix_cache.match(token_ids, block_size,
                                                               (len(token_ids) - 1) // block_size)
        keys, values = read_blocks(self.kv_cache, [hit.block for hit in hits])
        return KVPayload(transfer_id, self.kv_layout, list(token_ids[: len(hits) * block_size]), keys, values)

    def import_prefix(self, payload: KVPayload) -> int:
        """Take another engine's blocks into this pool and prefix cache, held until `release_import` (so a
        request whose prompt starts with their tokens finds them cached and computes only the rest). Returns the
        tokens written (blocks this cache held already are not). ValueError, and nothing taken, for a payload of
        another layout (model, dtype, block size, pool storage or scales), of token ids this model has not or more
        than its context, or of more blocks than are free."""
        self.check_kv_transfer()
        mismatch = self.kv_layout.mismatch(payload.layout)
        if mismatch is not None:
            raise ValueError(f"refused KV transfer {payload.transfer_id!r}: {mismatch}")
        vocab_size = self.model.config.vocab_size
        if payload.num_tokens >= self.max_model_len:
            raise ValueError(f"refused KV transfer {payload.transfer_id!r}: {payload.num_tokens} tokens leave no room "
                             f"in a context of {self.max_model_len}")
        if not all(0 <= token < vocab_size for token in payload.token_ids):
            raise ValueError(f"refused KV transfer {payload.transfer_id!r}: token ids outside the vocabulary "
                             f"[0, {vocab_size})")
        if not self.block_manager.can_allocate(payload.token_ids):
            raise ValueError(f"refused KV transfer {payload.transfer_id!r}: {payload.num_blocks} blocks do not fit "
                             f"in the {self.block_manager.num_free_blocks} free")
        blocks, cached = self.block_manager.import_prefix(("kv-import", payload.transfer_id), payload.token_ids)
        write_blocks(self.kv_cache, blocks[cached:], payload.keys[:, cached:], payload.values[:, cached:])
        return (len(blocks) - cached) * self.config.block_size

    def release_import(self, transfer_id: str) -> None:
        """The blocks `import_prefix` took for `transfer_id` become ordinary cached blocks (evictable)."""
        self.block_manager.release_import(("kv-import", transfer_id))

    def reset_prefix_cache(self) -> int:
        """Forget every cached block no request holds, as vLLM's `reset_prefix_cache` (a benchmark that must start
        cold); the blocks freed. Blocks in use, and received ones not yet claimed, keep their names."""
        return self.block_manager.reset_prefix_cache()

    def stats(self) -> EngineStats:
        blocks, scheduler, graphs = self.block_manager, self.scheduler, self.model_runner.graphs
        return EngineStats(
            num_total_blocks=blocks.num_total_blocks,
            num_free_blocks=blocks.num_free_blocks,
            num_cached_blocks=len(blocks.allocator.prefix_cache),
            block_size=blocks.block_size,
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting) + sum(len(forks) for forks in scheduler.forks.values()),
            num_preemptions=scheduler.num_preemptions,
            prefix_cache_queried_tokens=scheduler.num_prefix_queried_tokens,
            prefix_cache_hit_tokens=scheduler.num_prefix_hit_tokens,
            num_failed_requests=self.num_failed_requests,
            num_waiting_requests=scheduler.num_waiting_requests(),
            attention_backend=self.attention_backend.name,
            prepacked_weights=self._prepacked_weights,
            pointwise_ops=self._pointwise_ops,
            cuda_graph_sizes=graphs.sizes if graphs is not None else (),
            num_graph_replays=graphs.num_replays if graphs is not None else 0,
            compiled_model=self.model_runner.compiled is not None,
            num_compiled_steps=self.model_runner.compiled.num_runs if self.model_runner.compiled is not None else 0,
            native_step=self.model_runner.native is not None,
            num_native_steps=self.model_runner.native.num_runs if self.model_runner.native is not None else 0,
            **({} if self.spec_stats is None else dict(
                num_draft_tokens=self.spec_stats.num_draft_tokens,
                num_accepted_tokens=self.spec_stats.num_accepted_tokens,
                accepted_length_counts=tuple(self.spec_stats.accepted_counts))),
            num_forced_tokens=self.num_forced_tokens,
            num_accepted_forced_tokens=self.num_accepted_forced_tokens,
        )

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """One iteration: (propose,) schedule, run the model, postprocess; returns outputs of requests that
        progressed (or failed). Raises EngineDeadError once the device itself failed (is_device_fault)."""
        if self.dead_reason is not None:
            raise EngineDeadError(f"the engine's device failed; create a new engine: {self.dead_reason!r}")
        self.last_step = None  # (a step that schedules nothing leaves none)
        start = time.perf_counter()
        if self.proposer is not None:
            self._propose()
            proposed = time.perf_counter()
            self.profile.propose += proposed - start
            start = proposed
        if any(seq.grammar is not None for seq in self.scheduler.running):
            self._constrain_drafts()
            constrained = time.perf_counter()
            self.profile.grammar += constrained - start
            start = constrained
        batch = self.scheduler.schedule()
        self._num_idle_steps = 0 if batch.items or not self.has_unfinished_requests() else self._num_idle_steps + 1
        if not batch.items:
            if self.config.check_invariants:
                self.check_invariants()
            return []
        scheduled = time.perf_counter()
        self.profile.schedule += scheduled - start
        with self._compute_threads():
            result = self._run(batch)
        now = time.perf_counter()
        self._record_speculation(batch, result)
        self.scheduler.postprocess(batch, result.sampled, now, result.accepted)
        for seq, chunk_start, entries in result.prompt_logprobs:
            self.output_processor.add_prompt_logprobs(seq.request_id, chunk_start, entries)
        processed = self.output_processor.process(batch.request_ids, result.logprobs, now)
        self.scheduler.finish(processed.finished)  # ended by a stop string: free their blocks now
        for request_id in processed.failed:  # every sequence of the request leaves, a waiting sibling's too
            self._fail(request_id)
        if self.proposer is not None:  # a draft model's blocks go back with the sequences that left this step
            self.proposer.keep_only(set(self.scheduler.running))
        self._record(batch, result, start, now)
        self._num_steps += 1
        self.profile.postprocess += time.perf_counter() - now
        self.profile.num_steps += 1
        if self.config.check_invariants:
            self.check_invariants()
        return processed.outputs

    def _fail(self, request_id: str) -> None:
        """Finish every sequence of a request with an error, wherever it is (running, waiting, a fork to make),
        and free its blocks; its final output goes out from the output processor."""
        self.scheduler.abort(request_id, SequenceStatus.FINISHED_ERROR)
        self.num_failed_requests += 1

    def _propose(self) -> None:
        """Guesses for every running sequence whose next step is a decode; the proposer drops what it kept for
        sequences that left (finished, or preempted: they start again). If proposing fails, it is tried again
        one sequence at a time, and a sequence whose proposal fails again decodes without guesses from now on:
        speculation is an optimisation, and the target alone still gives its tokens exactly."""
        scheduler, proposer = self.scheduler, self.proposer
        assert proposer is not None
        self._unspeculated &= set(scheduler.running)
        proposer.keep_only(set(scheduler.running) - self._unspeculated)
        decoding = [seq for seq in scheduler.running if seq.num_uncomputed_tokens == 1 and seq not in scheduler.forks
                    and seq not in self._unspeculated]
        try:
            proposer.propose(decoding)
            return
        except Exception as error:
            if is_device_fault(error):
                self._die(error)
            logger.exception("proposing for %d sequences failed; retrying them one at a time", len(decoding))
        for seq in decoding:
            try:
                proposer.propose([seq])
            except Exception as error:
                if is_device_fault(error):
                    self._die(error)
                logger.exception("proposing for %r failed; it decodes without speculation from now on", seq)
                seq.draft_token_ids, seq.draft_probs = [], None
                self._unspeculated.add(seq)
        proposer.keep_only(set(scheduler.running) - self._unspeculated)

    def _constrain_drafts(self) -> None:
        """Drafts of constrained sequences about to decode (lesson 15): a proposer's are cut to the longest prefix
        their grammar allows (a refused draft could never be kept, and its mask could not be filled); where none
        remain, the tokens the grammar forces from here (jump-forward, up to `max_forced_tokens`) become the drafts.
        Forced drafts are sure guesses, verified as any other: the model keeps those it would have produced, so the
        output is what it would be without them, in fewer steps."""
        self._forced.clear()
        limit, scheduler = self.config.max_forced_tokens, self.scheduler
        for seq in scheduler.running:
            grammar = seq.grammar
            if grammar is None or seq.num_uncomputed_tokens != 1 or seq in scheduler.forks:
                continue
            if seq.draft_token_ids:
                kept = grammar.valid_prefix(seq.draft_token_ids)
                if len(kept) < len(seq.draft_token_ids):
                    seq.draft_token_ids = kept
                    seq.draft_probs = None if seq.draft_probs is None or not kept else seq.draft_probs[: len(kept)]
            if not seq.draft_token_ids and limit and self.tokenizer is not None:
                forced = grammar.forced_tokens(self.tokenizer, min(limit, seq.max_new_tokens - seq.num_output_tokens - 1))
                if forced:
                    seq.draft_token_ids, seq.draft_probs = forced, None
                    self._forced.add(seq)

    def _die(self, error: BaseException) -> None:
        """The device failed: nothing can run again in this process's CUDA context. The engine refuses every
        request and step from now on (EngineDeadError); what was live stays as it was until `shutdown()`."""
        logger.error("the device failed (%s: %s); the engine is dead", type(error).__name__, error)
        self.dead_reason = error
        raise EngineDeadError(f"the engine's device failed; create a new engine: {error!r}") from error

    def _record_speculation(self, batch: ScheduledBatch, result: ModelRunnerOutput) -> None:
        for item in batch.items:
            if not item.draft_token_ids or item.seq not in result.accepted:
                continue
            if item.seq in self._forced:  # the grammar's drafts, not the proposer's
                self.num_forced_tokens += len(item.draft_token_ids)
                self.num_accepted_forced_tokens += len(result.accepted[item.seq])
            elif self.spec_stats is not None:
                self.spec_stats.record(len(item.draft_token_ids), len(result.accepted[item.seq]))

    def _run(self, batch: ScheduledBatch) -> ModelRunnerOutput:
        """Run the step; if it fails, run it again one request at a time and fail only the requests
        whose part fails again. Rerunning is safe: nothing was recorded for the failed step, its KV
        writes go to the same slots again, copy-on-write copies are idempotent, and a seeded request's
        noise is a function of its seed and output length, so its retry draws the same noise. A fault of
        the device itself (is_device_fault) is not retried: it kills the engine, as does any failure of a sharded
        step before its sampling."""
        try:
            return self.model_runner.run(batch)
        except Exception as error:
            sharded_mid_step = self.workers is not None and not isinstance(error, SamplingError)
            if is_device_fault(error) or sharded_mid_step:
                # Sharded, a step that failed in its forward pass leaves the ranks at different points of it: none
                # can be retried. One that failed in sampling (SamplingError) had finished every collective.
                if self.workers is not None:
                    self.workers.failed = True
                    dead = self.workers.check()
                    error = error if dead is None else RuntimeError(dead)
                self._die(error)
            logger.exception("a step of %d requests failed; retrying them one at a time", len(batch.request_ids))
        result = ModelRunnerOutput()
        for part in batch.split_by_request():
            request_id = part.items[0].seq.request_id
            try:
                partial = self.model_runner.run(part)
            except Exception as error:
                if is_device_fault(error):
                    self._die(error)
                logger.exception("request %s failed; finishing it with an error", request_id)
                self._fail(request_id)
                continue
            result.sampled.update(partial.sampled)
            result.accepted.update(partial.accepted)
            result.logprobs.update(partial.logprobs)
            result.prompt_logprobs += partial.prompt_logprobs
        return result

    def check_invariants(self) -> None:
        """Assert the scheduler's and the block manager's books, and that unfinished work makes progress."""
        self.scheduler.check_invariants()
        live = {seq for state in self.requests.values() for seq in state.sequences if not seq.is_finished}
        scheduled = set(self.scheduler.running) | set(self.scheduler.waiting) | {
            child for children in self.scheduler.forks.values() for child in children}
        assert live == scheduled, "a live request's sequence is missing from the scheduler, or the reverse"
        if isinstance(self.proposer, DraftModelProposer):  # the draft's pool: only running sequences hold blocks
            draft_blocks = self.proposer.block_manager
            assert set(draft_blocks.block_tables) <= set(self.scheduler.running), "a draft block outlived its sequence"
            draft_blocks.check_invariants()
        # Only a fork made at admission leaves one step with nothing to run; two in a row means stuck.
        assert self._num_idle_steps < 2, "requests are waiting but no step can run them"

    def _record(self, batch: ScheduledBatch, result: ModelRunnerOutput, start: float, end: float) -> None:
        items = [(it.seq.request_id, it.seq.index, it.num_new_tokens, it.is_prefill) for it in batch.items]
        drafts = [(len(it.draft_token_ids), len(result.accepted.get(it.seq, ()))) for it in batch.items] \
            if any(it.draft_token_ids for it in batch.items) else []
        preempted = [(seq.request_id, seq.index) for seq in self.scheduler.last_preempted]
        self.last_step = StepRecord(self._num_steps, start, end - start, items, drafts, preempted)
        if self.config.record_steps:
            self.step_records.append(self.last_step)


def _check_tensor_parallel_budget(config: EngineConfig, device: torch.device) -> None:
    """On CUDA the KV budget comes from a profiled forward pass on rank 0 alone, which the other ranks would not
    join: a tensor-parallel engine there needs the pool's size given."""
    if device.type == "cuda" and config.num_kv_blocks is None and config.kv_cache_memory is None:
        raise ValueError("tensor_parallel_size > 1 on CUDA needs num_kv_blocks or kv_cache_memory (the memory "
                         "profile runs one rank's forward pass, not yet every rank's)")
