"""Every attention backend the CPU can run gives each request exactly its tokens when run alone.

The engine with each backend (float64 tiny models) under continuous batching with chunked prefill,
paging with prefix hits and forks (n > 1, copy-on-write), and memory pressure (preemption); the same in
bfloat16, where what is checked is the engine's bookkeeping; then how a backend is chosen: by name, by the
environment variable, automatically, and refused.
"""

from __future__ import annotations

import copy

import pytest
import torch

from llm_runtime import EngineConfig, LLMEngine, SamplingParams, generate
from llm_runtime.attention import available_backends, select_backend
from llm_runtime.config import ATTENTION_BACKEND_ENV

from test_engine import make_workload, run_engine
from workloads import BLOCK_SIZE, assert_no_leak, blocks_unconstrained, expected_alone, run_all, \
    shared_prefix_workload

CPU_BACKENDS = [name for name, reason in available_backends("cpu", torch.float64).items() if reason is None]
CPU_BACKENDS_FLOAT32 = [name for name, reason in available_backends("cpu", torch.float32).items() if reason is None]


def test_the_cpu_runs_the_reference_and_the_blockwise_backend() -> None:
    assert {"torch-gather", "blockwise"} <= set(CPU_BACKENDS)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_continuous_batching_with_chunked_prefill(tiny_pairs, backend: str) -> None:
    model, _ = tiny_pairs["llama3"]
    workload = make_workload(model.config.vocab_size, num_requests=24)
    engine = LLMEngine(model, None, EngineConfig(max_num_seqs=8, max_num_batched_tokens=96,
                                                 attention_backend=backend))
    assert engine.stats().attention_backend == backend
    results = run_engine(engine, workload)
    for i, (prompt, params) in enumerate(workload):
        assert results[str(i)] == generate(model, prompt, params), f"request {i} ({len(prompt)} tokens)"
    # The step profile times the attention layers, a part of the forward pass.
    profile = engine.profile
    assert 0 < profile.attention < profile.forward
    assert 0 < profile.fractions()["attention"] < profile.fractions()["forward"]
    # A reset zeroes it in place: the runner still fills the object the engine shows.
    profile.reset()
    assert profile.num_steps == 0 and profile.forward == 0.0 and engine.model_runner.profile is profile
    run_engine(engine, workload[:2])
    assert profile.num_steps > 0 and profile.forward > 0


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_prefix_hits_forks_and_preemption(tiny_pairs, backend: str) -> None:
    model, _ = tiny_pairs["qwen3"]  # 4 query heads over 2 KV heads
    workload = shared_prefix_workload(model.config.vocab_size, num_requests=24, seed=2)
    need = blocks_unconstrained(workload)
    largest = max(-(-(len(prompt) + p.max_tokens) // BLOCK_SIZE) for prompt, p in workload)
    engine = LLMEngine(model, None, EngineConfig(
        max_num_seqs=16, max_num_batched_tokens=128, block_size=BLOCK_SIZE,
        num_kv_blocks=max(need * 15 // 100, largest), enable_prefix_caching=True, attention_backend=backend))
    results = run_all(engine, workload, arrive_every=1)
    for i, expected in enumerate(expected_alone(model, workload)):
        assert results[str(i)] == [expected] * workload[i][1].n, f"request {i}"
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hit_tokens > 0
    assert_no_leak(engine)


# Triton's kernels run under its interpreter on a CPU, minutes for this workload: test_triton_attention.py has them.
CPU_BACKENDS_BFLOAT16 = [name for name, reason in available_backends("cpu", torch.bfloat16).items()
                         if reason is None and name != "triton"]


@pytest.mark.parametrize("backend", CPU_BACKENDS_BFLOAT16)
def test_a_bfloat16_engine_under_prefix_hits_forks_and_preemption(tiny_pairs, backend: str) -> None:
    """In bfloat16 (what a GPU runs) a request's tokens depend on the rows it was batched with, so they are not
    compared with a run alone; what must hold is the engine's: every completion of every request, every block
    back, and the same schedule giving the same tokens twice. (The lessons' H100-profile pass, in bfloat16, leaves
    the scheduling lessons out on the strength of this test: their token checks run on float32 copies.)"""
    model = copy.deepcopy(tiny_pairs["qwen3"][0]).bfloat16()
    workload = shared_prefix_workload(model.config.vocab_size, num_requests=24, seed=2)
    need = blocks_unconstrained(workload)
    largest = max(-(-(len(prompt) + p.max_tokens) // BLOCK_SIZE) for prompt, p in workload)
    runs = []
    for _ in range(2):
        engine = LLMEngine(model, None, EngineConfig(
            max_num_seqs=16, max_num_batched_tokens=128, block_size=BLOCK_SIZE,
            num_kv_blocks=max(need * 15 // 100, largest), enable_prefix_caching=True, attention_backend=backend))
        runs.append(run_all(engine, workload, arrive_every=1))
        stats = engine.stats()
        assert stats.num_preemptions > 0 and stats.prefix_cache_hit_tokens > 0
        assert_no_leak(engine)
    for i, (_, params) in enumerate(workload):
        completions = runs[0][str(i)]
        assert len(completions) == params.n and all(len(c) == params.max_tokens for c in completions), f"request {i}"
    assert runs[0] == runs[1]


def test_backend_by_environment_variable_and_automatic_choice(tiny_pairs, monkeypatch) -> None:
    model, _ = tiny_pairs["llama2"]
    # The CPU's default: the C kernel where it builds, in float32 and bfloat16; block-wise in float64.
    assert LLMEngine(model, None, EngineConfig()).stats().attention_backend == "blockwise"
    expected = "cpu" if available_backends("cpu", torch.float32)["cpu"] is None else "blockwise"
    float_model = copy.deepcopy(model).float()
    assert LLMEngine(float_model, None, EngineConfig()).stats().attention_backend == expected
    monkeypatch.setenv(ATTENTION_BACKEND_ENV, "torch-gather")
    assert LLMEngine(model, None, EngineConfig()).stats().attention_backend == "torch-gather"
    # A backend named in the config wins over the environment.
    assert LLMEngine(model, None, EngineConfig(attention_backend="blockwise")).stats().attention_backend == "blockwise"
    monkeypatch.setenv(ATTENTION_BACKEND_ENV, "fastest")
    with pytest.raises(ValueError, match=ATTENTION_BACKEND_ENV):
        LLMEngine(model, None, EngineConfig())


def test_unknown_or_impossible_backends_are_refused() -> None:
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineConfig(attention_backend="paged")
    # FlashAttention needs a CUDA GPU (sm80+) and half precision; the CPU cannot run it.
    with pytest.raises(ValueError, match="flash-attn"):
        select_backend("flash-attn", "cpu", torch.float32)
    assert available_backends("cpu", torch.float32)["flash-attn"] is not None


def test_triton_kernels_in_the_engine_give_the_reference_backends_tokens(tiny_pairs) -> None:
    """The Triton backend (on the CPU: its kernels under Triton's interpreter) in float32, where it runs:
    the same greedy tokens as the torch-gather engine, through chunked prefill, prefix hits and decodes."""
    if available_backends("cpu" if not torch.cuda.is_available() else "cuda", torch.float32)["triton"] is not None:
        pytest.skip("the triton backend cannot run here")
    model = copy.deepcopy(tiny_pairs["qwen3"][0]).float()
    prompts = [list(range(3, 40)), list(range(3, 40)) + [7, 8], [5] * 3, list(range(10, 60))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    tokens = {}
    for backend in ("torch-gather", "triton"):
        engine = LLMEngine(model, None, EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, num_kv_blocks=64,
                                                     attention_backend=backend))
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        finished = {}
        while engine.has_unfinished_requests():
            finished.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        assert engine.stats().prefix_cache_hit_tokens > 0
        tokens[backend] = finished
    assert tokens["triton"] == tokens["torch-gather"]


def test_the_c_kernel_in_the_engine_gives_the_reference_backends_tokens(tiny_pairs) -> None:
    """The `cpu` backend (decodes by the C kernel) in float32: the torch-gather engine's greedy tokens
    through chunked prefill, prefix hits, forks (n > 1) and preemption, with no block leaked."""
    if available_backends("cpu", torch.float32)["cpu"] is not None:
        pytest.skip("no C compiler builds the kernel here")
    model = copy.deepcopy(tiny_pairs["qwen3"][0]).float()  # 4 query heads over 2 KV heads
    workload = shared_prefix_workload(model.config.vocab_size, num_requests=24, seed=2)
    largest = max(-(-(len(prompt) + p.max_tokens) // BLOCK_SIZE) for prompt, p in workload)
    tokens = {}
    for backend in ("torch-gather", "cpu"):
        engine = LLMEngine(model, None, EngineConfig(
            max_num_seqs=16, max_num_batched_tokens=128, block_size=BLOCK_SIZE,
            num_kv_blocks=max(blocks_unconstrained(workload) * 15 // 100, largest), enable_prefix_caching=True,
            attention_backend=backend))
        tokens[backend] = run_all(engine, workload, arrive_every=1)
        stats = engine.stats()
        assert stats.num_preemptions > 0 and stats.prefix_cache_hit_tokens > 0
        assert_no_leak(engine)
    assert tokens["cpu"] == tokens["torch-gather"]


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("backend", [b for b in CPU_BACKENDS_FLOAT32 if b != "triton"])
def test_a_quantized_kv_cache_under_prefix_hits_forks_and_preemption(tiny_pairs, backend: str,
                                                                     kv_cache_dtype: str) -> None:
    """An 8-bit pool stores each element by itself (int8: with scales fixed before the first request), so
    batching, paging, prefix hits, forks and preemption change nothing: every request gets the tokens it gets
    alone with the same pool, and no block leaks. (Alone against the full-precision engine, the tokens may
    differ: that is the quantization.)"""
    model = copy.deepcopy(tiny_pairs["qwen3"][0]).float()
    workload = shared_prefix_workload(model.config.vocab_size, num_requests=16, seed=3)
    need = blocks_unconstrained(workload)
    largest = max(-(-(len(prompt) + p.max_tokens) // BLOCK_SIZE) for prompt, p in workload)
    options = dict(block_size=BLOCK_SIZE, attention_backend=backend, kv_cache_dtype=kv_cache_dtype)
    engine = LLMEngine(model, None, EngineConfig(max_num_seqs=16, max_num_batched_tokens=128,
                                                 num_kv_blocks=max(need * 15 // 100, largest), **options))
    assert engine.kv_cache.keys[0].dtype == {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[kv_cache_dtype]
    results = run_all(engine, workload, arrive_every=1)
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hit_tokens > 0
    assert_no_leak(engine)
    alone = LLMEngine(model, None, EngineConfig(num_kv_blocks=64, enable_prefix_caching=False, **options))
    for i, (prompt, params) in enumerate(workload):
        single = SamplingParams(temperature=0, max_tokens=params.max_tokens, ignore_eos=True)
        expected = run_all(alone, [(prompt, single)])["0"][0]
        assert results[str(i)] == [expected] * params.n, f"request {i}"
