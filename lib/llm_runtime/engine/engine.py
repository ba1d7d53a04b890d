"""`LLMEngine`: requests in, one step at a time, outputs out (vLLM's layer under `LLM`).

    engine.add_request("a", "Hello", SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for output in engine.step():       # schedule -> run -> postprocess
            print(output.request_id, output.outputs[0].text_delta)

Bad input is refused in `add_request` with a ValueError, before anything enters the engine, so the
requests already running are never disturbed by it. That includes a prompt that could never fit
in the KV pool, which would otherwise wait forever.

The engine owns the KV pool (`PagedKVCache`) and its bookkeeping (`BlockManager`); `stats()`
reports both, with the scheduler's preemption and prefix-cache counters.
"""

from __future__ import annotations

import time
from collections import abc
from dataclasses import dataclass, replace

from ..attention.kv_cache import PagedKVCache, kv_block_bytes, num_blocks_in
from ..config import DEFAULT_CPU_KV_CACHE_MEMORY, EngineConfig
from ..model import CausalLM
from ..model.tokenizer import Tokenizer
from ..sampling import Sampler, SamplingParams
from .block_manager import BlockManager
from .detokenizer import IncrementalDetokenizer
from .generate import max_new_tokens, validate_prompt
from .model_runner import ModelRunner, StepProfile, profile_kv_cache_memory
from .outputs import RequestOutput, completion_output, request_metrics
from .scheduler import ScheduledBatch, Scheduler, StepRecord
from .sequence import Sequence

# What `add_request` accepts as a prompt: text, token ids, or vLLM's dict forms.
Prompt = str | list[int] | dict


@dataclass
class EngineRequest:
    """A validated request: its tokens and the n sequences that will complete it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[Sequence]
    num_tokens_sent: list[int]


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's memory and queues (lessons, tests and benchmarks read it)."""

    num_total_blocks: int
    num_free_blocks: int  # never used or cached-but-unreferenced (evictable)
    num_cached_blocks: int  # blocks named in the prefix cache, held or not
    block_size: int
    num_running: int
    num_waiting: int
    num_preemptions: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int

    @property
    def num_used_blocks(self) -> int:
        return self.num_total_blocks - self.num_free_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        queried = self.prefix_cache_queried_tokens
        return self.prefix_cache_hit_tokens / queried if queried else 0.0


class LLMEngine:
    """Holds the KV pool, the scheduler, the model runner and every live request."""

    def __init__(self, model: CausalLM, tokenizer: Tokenizer | None, config: EngineConfig | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config or EngineConfig()
        limit = model.config.max_position_embeddings
        if self.config.max_model_len is not None and self.config.max_model_len > limit:
            raise ValueError(f"max_model_len {self.config.max_model_len} is beyond the model's {limit} positions")
        num_blocks = self._num_kv_blocks(self.config.max_model_len or limit)
        block_size = self.config.block_size
        if self.config.max_model_len is not None and self.config.max_model_len > num_blocks * block_size:
            raise ValueError(
                f"max_model_len {self.config.max_model_len} needs more KV memory than the pool's {num_blocks} "
                f"blocks of {block_size} tokens; lower max_model_len or give the engine more KV memory "
                f"(num_kv_blocks, kv_cache_memory or gpu_memory_utilization)"
            )
        self.context_limit = self.config.max_model_len or limit
        # Unless asked for, a context longer than the whole pool is not offered.
        self.max_model_len = min(self.context_limit, num_blocks * block_size)
        self.kv_cache = PagedKVCache.for_model(model.config, num_blocks, block_size, dtype=model.dtype,
                                               device=model.device)
        self.block_manager = BlockManager(num_blocks, block_size, self.config.enable_prefix_caching)
        self.scheduler = Scheduler(self.config, self.block_manager)
        self.profile = StepProfile()  # where step time goes (lesson 09, bench)
        self.model_runner = ModelRunner(model, Sampler(seed=self.config.seed, device=model.device), self.kv_cache,
                                        self.profile)
        self.requests: dict[str, EngineRequest] = {}
        self.step_records: list[StepRecord] = []
        self._num_steps = 0

    def _num_kv_blocks(self, max_model_len: int) -> int:
        """The pool size: num_kv_blocks, else kv_cache_memory, else profiled (CUDA) or a default (CPU)."""
        config, model = self.config, self.model
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        if config.kv_cache_memory is not None:
            nbytes = config.kv_cache_memory
        elif model.device.type == "cuda":
            nbytes = profile_kv_cache_memory(model, config)
        else:  # CPU: room for max_num_seqs full-length sequences, within a fixed cap
            full = config.max_num_seqs * max_model_len * kv_block_bytes(model.config, 1, model.dtype)
            nbytes = min(DEFAULT_CPU_KV_CACHE_MEMORY, full)
        num_blocks = num_blocks_in(nbytes, model.config, config.block_size, model.dtype)
        if num_blocks < 1:
            raise ValueError(f"{nbytes} bytes of KV memory hold no block of {config.block_size} tokens "
                             f"({kv_block_bytes(model.config, config.block_size, model.dtype)} bytes each)")
        return num_blocks

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Validate and enqueue a request; raises ValueError (and changes nothing) on bad input."""
        self.add_prepared(self.prepare_request(request_id, prompt, params, arrival_time))

    def prepare_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> EngineRequest:
        """Validate and tokenize a request without touching the engine's state (the async engine
        validates this way while a step runs, and adds the request between steps)."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"n = {params.n} completions cannot run at once under max_num_seqs = "
                             f"{self.config.max_num_seqs}")
        text, token_ids = self._tokenize(prompt)
        token_ids = validate_prompt(token_ids, self.model.config.vocab_size, self.context_limit)
        blocks = self.block_manager
        needed = blocks.blocks_needed(len(token_ids) + 1)  # the prompt and at least one new token
        if needed > blocks.num_total_blocks:
            raise ValueError(
                f"prompt of {len(token_ids)} tokens needs {needed} KV blocks of {blocks.block_size} tokens, "
                f"but the whole pool has {blocks.num_total_blocks}: it could never run (give the engine more "
                f"KV memory: num_kv_blocks, kv_cache_memory or gpu_memory_utilization)"
            )
        budget = max_new_tokens(params, len(token_ids), self.max_model_len)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this engine has none (use stop_token_ids)")
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        sequences = []
        for index in range(params.n):
            # As vLLM does for n > 1, completion i of a seeded request uses seed + i.
            seq_params = params if params.seed is None or index == 0 else replace(params, seed=params.seed + index)
            detokenizer = None
            if self.tokenizer is not None:
                detokenizer = IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens)
            sequences.append(Sequence(
                request_id, token_ids, seq_params, max_new_tokens=budget,
                eos_token_ids=self.model.config.eos_token_ids, detokenizer=detokenizer, index=index,
                arrival_time=arrival, generator=seq_params.make_generator(self.model.device),
            ))
        return EngineRequest(request_id, text, token_ids, sequences, [0] * params.n)

    def add_prepared(self, request: EngineRequest) -> None:
        """Enqueue a request made by `prepare_request`."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.scheduler.add(request.sequences[0], request.sequences[1:])

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return None, prompt["prompt_token_ids"]
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a dict prompt needs a 'prompt' or 'prompt_token_ids' key")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; pass token ids instead")
            if not prompt:
                raise ValueError("prompt is empty: give at least one token")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, abc.Sequence) and not isinstance(prompt, bytes):
            return None, list(prompt)
        raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def abort_request(self, request_id: str) -> None:
        """Stop a request now; its sequences finish with reason "abort" and free their caches."""
        if request_id not in self.requests:
            raise ValueError(f"unknown request id {request_id!r} (never added, or already finished)")
        self.scheduler.abort(request_id)
        del self.requests[request_id]

    def stats(self) -> EngineStats:
        blocks, scheduler = self.block_manager, self.scheduler
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
        )

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, run the model, postprocess; returns outputs of requests that progressed."""
        start = time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch.items:
            return []
        scheduled = time.perf_counter()
        self.profile.schedule += scheduled - start
        sampled, logprobs = self.model_runner.run(batch)
        now = time.perf_counter()
        self.scheduler.postprocess(batch, sampled, now, logprobs)
        if self.config.record_steps:
            self._record(batch, start, now)
        self._num_steps += 1
        outputs = []
        for request_id in dict.fromkeys(item.seq.request_id for item in batch.items):
            request = self.requests.get(request_id)
            if request is not None:
                outputs.append(self._make_output(request))
        self.profile.postprocess += time.perf_counter() - now
        self.profile.num_steps += 1
        return outputs

    def _make_output(self, request: EngineRequest) -> RequestOutput:
        completions = []
        for i, seq in enumerate(request.sequences):
            completions.append(completion_output(seq, request.num_tokens_sent[i]))
            request.num_tokens_sent[i] = seq.num_output_tokens
        finished = all(seq.is_finished for seq in request.sequences)
        if finished:
            del self.requests[request.request_id]
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions,
                             finished, request_metrics(request.sequences))

    def _record(self, batch: ScheduledBatch, start: float, end: float) -> None:
        items = [(it.seq.request_id, it.seq.index, it.num_new_tokens, it.is_prefill) for it in batch.items]
        self.step_records.append(StepRecord(self._num_steps, start, end - start, items))
