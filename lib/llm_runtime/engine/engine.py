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

The engine is three layers, each knowing only the one below (docs/architecture.md): this class turns requests
into sequences and steps into outputs (the input and output processors); the `EngineCore` (engine_core.py)
schedules and keeps the KV blocks' books; the `Executor` (executor/) runs each step on the workers that own the
device, set up once from a plan (worker/plan.py). `stats()` reports the pool, the queues, the counters and the
plan.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from ..attention.backend import AttentionBackend
from ..attention.kv_cache import PagedKVCache
from ..config import EngineConfig
from ..core.block_manager import BlockManager
from ..core.scheduler import Scheduler, StepRecord
from ..core.sequence import Sequence
from ..device import resolve_device
from ..errors import EngineDeadError, InvalidRequestError
from ..executor import Executor, ShardWorkers, check_tensor_parallel_budget, make_executor, start_shard_workers
from ..kv_transfer.payload import KVLayout, KVPayload, read_blocks, write_blocks
from ..model import CausalLM, load_model
from ..model.pointwise import pointwise_ops_of
from ..model.packed_linear import is_packed
from ..model.tokenizer import Tokenizer
from ..sampling import SamplingParams
from ..spec_decode.proposer import Proposer
from ..spec_decode.stats import SpeculationStats
from ..structured_output import GrammarState
from ..worker.model_runner import ModelRunner, StepProfile
from ..worker.plan import ModelPlan
from .engine_core import EngineCore
from .input_processor import EngineRequest, InputProcessor, Messages, Prompt
from .output_processor import OutputProcessor, RequestState
from .outputs import RequestOutput
from .stats import EngineStats

logger = logging.getLogger(__name__)

__all__ = ["EngineRequest", "EngineStats", "LLMEngine", "Messages", "Prompt"]


class LLMEngine:
    """Requests in, outputs out: the input and output processors over the engine core and its executor."""

    def __init__(self, model: CausalLM, tokenizer: Tokenizer | None, config: EngineConfig | None = None, *,
                 owns_model: bool = False, draft_model: CausalLM | None = None,
                 workers: ShardWorkers | None = None) -> None:
        """`owns_model`: the caller loaded `model` for this engine alone (`LLM(...)`, `serve`), so the engine
        may change it in place (`prepack_weights`); a model passed in from outside is left as it is unless
        the config asks. `draft_model`: an already loaded draft for a "draft" `speculative_config` (else the
        engine loads the one the config names). `workers`: the other ranks of a tensor_parallel_size > 1 engine,
        when `model` is already rank 0's shard of their group (LLM(...) starts them; else the engine does)."""
        self.tokenizer = tokenizer
        self.config = config = config or EngineConfig()
        try:
            context_len = self._context_len(model, config)
        except BaseException:
            if workers is not None:  # a half-built engine leaves no worker behind
                workers.close()
            raise
        self.executor: Executor = make_executor(model, tokenizer, config, owns_model=owns_model,
                                                draft_model=draft_model, context_len=context_len, workers=workers)
        self.is_shut_down = False
        self.max_model_len = self.executor.max_model_len
        try:
            self.engine_core = EngineCore(config, self.executor, tokenizer)
            self.input_processor = InputProcessor(tokenizer, model.config, config, context_len=context_len,
                                                  max_model_len=self.max_model_len,
                                                  num_kv_blocks=self.executor.num_blocks)
        except BaseException:
            self.executor.shutdown()  # its pool, and a tensor-parallel engine's workers
            raise
        self.output_processor = OutputProcessor(tokenizer)
        self._kv_layout: KVLayout | None = None  # what this pool's blocks mean (KV transfer), once asked
        # How the model was set up for this engine, read once: finding out walks every module (0.3 ms for the
        # bundled model), and a server's loop takes stats() two or three times a step.
        self._prepacked_weights, self._pointwise_ops = is_packed(model), pointwise_ops_of(model).name
        self._plan_text = self.executor.plan.describe()
        logger.info("%s", self._plan_text)

    @staticmethod
    def _context_len(model: CausalLM, config: EngineConfig) -> int:
        """The longest context the model and the config allow, before the pool's size is known."""
        limit = model.config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(f"max_model_len {config.max_model_len} is beyond the model's {limit} positions")
        # Without chunked prefill a whole prompt (after a preemption: prompt + output) must fit in one step.
        step_limit = None if config.enable_chunked_prefill else config.max_num_batched_tokens + 1
        if config.max_model_len is not None and step_limit is not None and config.max_model_len > step_limit:
            raise ValueError(f"max_model_len {config.max_model_len} cannot be scheduled with enable_chunked_prefill="
                             f"False and max_num_batched_tokens={config.max_num_batched_tokens}: a sequence must "
                             f"fit in one step (max_model_len <= max_num_batched_tokens + 1)")
        return min(config.max_model_len or limit, step_limit or limit)

    @classmethod
    def from_pretrained(cls, model: str | Path | None = None, *, device: str | torch.device = "auto",
                        dtype: str | torch.dtype = "auto", quantization: str | None = None,
                        config: EngineConfig | None = None) -> "LLMEngine":
        """An engine with a model of its own, loaded by `load_model` (`owns_model`): with tensor_parallel_size > 1,
        the workers are started first and every rank, this one included, reads only its own shard."""
        config = config or EngineConfig()
        workers = None
        if config.tensor_parallel_size > 1:
            check_tensor_parallel_budget(config, torch.device(resolve_device(device)))
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

    # ------------------------------------------------------------------ what the layers below hold
    @property
    def model(self) -> CausalLM:
        return self.executor.model

    @property
    def plan(self) -> ModelPlan:
        return self.executor.plan

    @property
    def kv_cache(self) -> PagedKVCache:
        return self.executor.kv_cache

    @property
    def model_runner(self) -> ModelRunner:
        return self.executor.model_runner

    @property
    def attention_backend(self) -> AttentionBackend:
        return self.executor.worker.attention_backend

    @property
    def workers(self) -> ShardWorkers | None:
        """The other ranks of a tensor-parallel engine (None for one rank)."""
        return getattr(self.executor, "workers", None)

    @property
    def draft_model(self) -> CausalLM | None:
        return self.executor.worker.draft_model

    @property
    def native_weights(self) -> nn.Module | None:
        return self.executor.worker.native_weights

    @property
    def kv_pool_bytes(self) -> int:
        """The bytes of every KV pool this engine holds: its own and its draft model's."""
        return self.executor.worker.kv_pool_bytes

    @property
    def device_models(self) -> list[nn.Module]:
        return self.executor.worker.device_models

    @property
    def scheduler(self) -> Scheduler:
        return self.engine_core.scheduler

    @property
    def block_manager(self) -> BlockManager:
        return self.engine_core.block_manager

    @property
    def proposer(self) -> Proposer | None:
        return self.engine_core.proposer

    @proposer.setter
    def proposer(self, proposer: Proposer | None) -> None:
        self.engine_core.proposer = proposer

    @property
    def profile(self) -> StepProfile:
        return self.engine_core.profile

    @property
    def spec_stats(self) -> SpeculationStats | None:
        return self.engine_core.spec_stats

    @property
    def dead_reason(self) -> BaseException | None:
        return self.engine_core.dead_reason

    @property
    def step_records(self) -> list[StepRecord]:
        return self.engine_core.step_records

    @property
    def last_step(self) -> StepRecord | None:
        return self.engine_core.last_step

    def shutdown(self) -> None:
        """Abort every live request and give the KV pool's memory back (on CUDA, to the driver too); a
        tensor-parallel engine's workers stop. The engine refuses new requests afterwards. Calling it twice is
        harmless."""
        if self.is_shut_down:
            return
        for request_id in list(self.requests):
            self.abort_request(request_id)
        self.is_shut_down = True
        self.input_processor.close()
        self.executor.shutdown()

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
        self.engine_core.check_alive()
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
            self.engine_core.add(sequences)
        except BaseException:
            self.output_processor.abort_request(request.request_id)
            raise

    def abort_request(self, request_id: str) -> None:
        """Stop a request now; its sequences finish with reason "abort" and free their caches."""
        if request_id not in self.requests:
            raise ValueError(f"unknown request id {request_id!r} (never added, or already finished)")
        self.engine_core.abort(request_id)
        self.output_processor.abort_request(request_id)

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
        hits = self.engine_core.block_manager.allocator.prefix_cache.match(token_ids, block_size,
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
        if not self.engine_core.block_manager.can_allocate(payload.token_ids):
            raise ValueError(f"refused KV transfer {payload.transfer_id!r}: {payload.num_blocks} blocks do not fit "
                             f"in the {self.engine_core.block_manager.num_free_blocks} free")
        blocks, cached = self.engine_core.block_manager.import_prefix(("kv-import", payload.transfer_id), payload.token_ids)
        write_blocks(self.kv_cache, blocks[cached:], payload.keys[:, cached:], payload.values[:, cached:])
        return (len(blocks) - cached) * self.config.block_size

    def release_import(self, transfer_id: str) -> None:
        """The blocks `import_prefix` took for `transfer_id` become ordinary cached blocks (evictable)."""
        self.engine_core.block_manager.release_import(("kv-import", transfer_id))

    def reset_prefix_cache(self) -> int:
        """Forget every cached block no request holds, as vLLM's `reset_prefix_cache` (a benchmark that must start
        cold); the blocks freed. Blocks in use, and received ones not yet claimed, keep their names."""
        return self.engine_core.block_manager.reset_prefix_cache()

    def stats(self) -> EngineStats:
        core, runner = self.engine_core, self.model_runner
        blocks, scheduler, graphs = core.block_manager, core.scheduler, runner.graphs
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
            num_failed_requests=core.num_failed_requests,
            num_waiting_requests=scheduler.num_waiting_requests(),
            attention_backend=self.attention_backend.name,
            prepacked_weights=self._prepacked_weights,
            pointwise_ops=self._pointwise_ops,
            cuda_graph_sizes=graphs.sizes if graphs is not None else (),
            num_graph_replays=graphs.num_replays if graphs is not None else 0,
            compiled_model=runner.compiled is not None,
            num_compiled_steps=runner.compiled.num_runs if runner.compiled is not None else 0,
            native_step=runner.native is not None,
            num_native_steps=runner.native.num_runs if runner.native is not None else 0,
            **({} if core.spec_stats is None else dict(
                num_draft_tokens=core.spec_stats.num_draft_tokens,
                num_accepted_tokens=core.spec_stats.num_accepted_tokens,
                accepted_length_counts=tuple(core.spec_stats.accepted_counts))),
            num_forced_tokens=core.num_forced_tokens,
            num_accepted_forced_tokens=core.num_accepted_forced_tokens,
            plan=self._plan_text,
        )

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """One iteration: the core's step (propose, schedule, run the model), then the outputs; returns outputs of
        requests that progressed (or failed). Raises EngineDeadError once the device itself failed
        (is_device_fault)."""
        step = self.engine_core.step(self.has_unfinished_requests())
        if step is None:
            if self.config.check_invariants:
                self.check_invariants()
            return []
        result = step.result
        for seq, chunk_start, entries in result.prompt_logprobs:
            self.output_processor.add_prompt_logprobs(seq.request_id, chunk_start, entries)
        processed = self.output_processor.process(step.batch.request_ids, result.logprobs, step.computed)
        self.engine_core.finish_step(step, processed.finished, processed.failed)
        if self.config.check_invariants:
            self.check_invariants()
        return processed.outputs

    def check_invariants(self) -> None:
        """Assert the scheduler's and the block manager's books, and that unfinished work makes progress."""
        live = {seq for state in self.requests.values() for seq in state.sequences if not seq.is_finished}
        self.engine_core.check_invariants(live)
