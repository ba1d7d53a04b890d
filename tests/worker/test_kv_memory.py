"""KV memory in the engine: paging, prefix caching, n > 1 with copy-on-write, preemption, admission, leaks.

Every run checks the same two things: each request's tokens equal what it gets alone (`generate`,
float64 tiny models; transformers for the bundled model), and afterwards every block is free.
"""

from __future__ import annotations


import pytest
import torch

from conftest import transformers_greedy
from llm_runtime import LLM, EngineConfig, LLMEngine, SamplingParams, generate
from llm_runtime.attention.kv_cache import kv_block_bytes
from llm_runtime.worker.kv_budget import CPU_DEVICE, activation_bytes
from llm_runtime.errors import EngineDeadError
from llm_runtime.model.tokenizer import encode_chat
from workloads import BLOCK_SIZE, assert_no_leak, blocks_unconstrained, expected_alone, run_all, shared_prefix_workload

@pytest.mark.parametrize("family", ["llama3", "qwen3", "qwen2"])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_paging_and_prefix_caching_give_each_request_its_own_tokens(tiny_pairs, family, prefix_caching) -> None:
    model, _ = tiny_pairs[family]
    workload = shared_prefix_workload(model.config.vocab_size)
    engine = LLMEngine(model, None, EngineConfig(max_num_seqs=8, max_num_batched_tokens=96, block_size=BLOCK_SIZE,
                                                 num_kv_blocks=400, enable_prefix_caching=prefix_caching))
    results = run_all(engine, workload)
    for i, expected in enumerate(expected_alone(model, workload)):
        assert results[str(i)] == [expected] * workload[i][1].n, f"request {i}"
    stats = engine.stats()
    assert stats.num_preemptions == 0  # plenty of memory here
    assert stats.prefix_cache_queried_tokens >= sum(len(prompt) for prompt, _ in workload)
    if prefix_caching:
        # The system prompt's 4 full blocks and the repeats' full blocks were found, not recomputed.
        assert stats.prefix_cache_hit_tokens >= 10 * 4 * BLOCK_SIZE and stats.num_cached_blocks > 0
    else:
        assert stats.prefix_cache_hit_tokens == 0 and stats.num_cached_blocks == 0
    assert_no_leak(engine)


@pytest.mark.parametrize("family", ["llama2", "qwen3", "smollm2"])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_memory_pressure_preempts_and_every_request_still_finishes(tiny_pairs, family, prefix_caching) -> None:
    model, _ = tiny_pairs[family]
    workload = shared_prefix_workload(model.config.vocab_size, seed=2)
    need = blocks_unconstrained(workload)
    largest = max(-(-(len(prompt) + p.max_tokens) // BLOCK_SIZE) for prompt, p in workload)
    num_blocks = max(need * 15 // 100, largest)
    assert 0.10 <= num_blocks / need <= 0.20
    engine = LLMEngine(model, None, EngineConfig(max_num_seqs=16, max_num_batched_tokens=128, block_size=BLOCK_SIZE,
                                                 num_kv_blocks=num_blocks, enable_prefix_caching=prefix_caching))
    results = run_all(engine, workload, arrive_every=1)
    for i, expected in enumerate(expected_alone(model, workload)):
        assert results[str(i)] == [expected] * workload[i][1].n, f"request {i}"
    assert engine.stats().num_preemptions > 0
    assert_no_leak(engine)


def test_parallel_sampling_shares_the_prompt_and_copies_on_write(tiny_pairs) -> None:
    model, _ = tiny_pairs["llama3"]
    prompt = list(range(3, 43))  # 40 tokens: 2 full blocks and 8 tokens of a third
    engine = LLMEngine(model, None, EngineConfig(block_size=BLOCK_SIZE, num_kv_blocks=64))
    engine.add_request("r", prompt, SamplingParams(n=4, temperature=0, max_tokens=20, ignore_eos=True))
    engine.step()  # the parent computes tokens 0..38; the three others fork from it
    tables = list(engine.block_manager.block_tables.values())
    assert len(tables) == 4 and all(table == tables[0] for table in tables)
    assert [engine.block_manager.allocator.ref_counts[b] for b in tables[0]] == [4, 4, 4]
    engine.step()  # each writes token 39 into the shared third block: three copy it first
    tables = list(engine.block_manager.block_tables.values())
    assert {tuple(t[:2]) for t in tables} == {tuple(tables[0][:2])} and len({t[2] for t in tables}) == 4
    assert engine.stats().num_used_blocks == 2 + 4  # against 4 x 3 = 12 without sharing
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.finished), final)
    alone = generate(model, prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert final is not None and [c.token_ids for c in final.outputs] == [alone] * 4
    assert_no_leak(engine)


def test_seeded_parallel_sampling_survives_preemption(tiny_pairs) -> None:
    model, _ = tiny_pairs["qwen3"]
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=40, ignore_eos=True)
    others = [(list(range(5 + i, 60 + i)), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
              for i in range(6)]

    def completions(num_blocks: int) -> tuple[list[list[int]], int]:
        engine = LLMEngine(model, None, EngineConfig(block_size=8, num_kv_blocks=num_blocks))
        for i, (prompt, other) in enumerate(others):
            engine.add_request(f"o{i}", prompt, other)
        engine.add_request("r", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], params)
        final = None
        while engine.has_unfinished_requests():
            final = next((o for o in engine.step() if o.finished and o.request_id == "r"), final)
        assert_no_leak(engine)
        return [c.token_ids for c in final.outputs], engine.stats().num_preemptions

    roomy, roomy_preemptions = completions(200)
    tight, tight_preemptions = completions(16)
    assert roomy_preemptions == 0 and tight_preemptions > 0
    assert tight == roomy and len({tuple(t) for t in tight}) == 3


def test_aborts_leak_nothing(tiny_pairs) -> None:
    model, _ = tiny_pairs["llama2"]
    engine = LLMEngine(model, None, EngineConfig(max_num_seqs=8, max_num_batched_tokens=32, block_size=8,
                                                 num_kv_blocks=40))
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    engine.add_request("keep", [1, 2, 3], greedy)
    engine.add_request("forking", list(range(3, 80)), SamplingParams(n=3, temperature=0, max_tokens=30,
                                                                      ignore_eos=True))
    for i in range(6):
        engine.add_request(f"r{i}", list(range(10 + i, 50 + i)), greedy)
    engine.step()
    assert engine.scheduler.forks  # "forking" is still prefilling in 32-token chunks: its siblings wait
    engine.abort_request("forking")
    for _ in range(4):
        engine.step()
    assert engine.stats().num_waiting > 0  # r5 has not been admitted yet
    engine.abort_request("r5")
    engine.abort_request("r0")  # running
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    assert sorted(finished) == ["keep", "r1", "r2", "r3", "r4"]
    assert finished["keep"] == generate(model, [1, 2, 3], greedy)
    assert finished["r3"] == generate(model, list(range(13, 53)), greedy)
    assert_no_leak(engine)


def test_a_request_that_can_never_fit_is_refused(tiny_pairs) -> None:
    model, _ = tiny_pairs["qwen2"]
    engine = LLMEngine(model, None, EngineConfig(block_size=16, num_kv_blocks=4))
    assert engine.max_model_len == 64  # the context offered shrinks to what the pool holds
    with pytest.raises(ValueError, match="needs 5 KV blocks of 16 tokens, but the whole pool has 4"):
        engine.add_request("big", [1] * 64, SamplingParams(max_tokens=1))
    greedy = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    engine.add_request("fits", [1] * 63, greedy)
    while engine.has_unfinished_requests():
        outputs = engine.step()
    assert outputs[0].outputs[0].token_ids == generate(model, [1] * 63, greedy)
    with pytest.raises(ValueError, match="max_model_len 100 needs more KV memory"):
        LLMEngine(model, None, EngineConfig(block_size=16, num_kv_blocks=4, max_model_len=100))
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine.add_request("wide", [1, 2], SamplingParams(n=40))


def test_kv_budget_from_bytes_and_cpu_default(tiny_pairs) -> None:
    model, _ = tiny_pairs["llama3"]
    block = kv_block_bytes(model.config, 16, model.dtype)
    assert block == 16 * 2 * model.config.num_layers * model.config.num_kv_heads * model.config.head_dim * 8
    engine = LLMEngine(model, None, EngineConfig(kv_cache_memory=10 * block + block // 2))
    assert engine.stats().num_total_blocks == 10
    assert engine.kv_cache.nbytes == 10 * block
    default = LLMEngine(model, None, EngineConfig(max_num_seqs=4))  # small model: what 4 sequences can use
    full = 4 * model.config.max_position_embeddings * block // 16
    assert default.stats().num_total_blocks == full // block
    # A length that is not a whole number of blocks gets its last block too (500 tokens: 32 blocks, not 31).
    odd = LLMEngine(model, None, EngineConfig(max_num_seqs=1, max_model_len=500))
    assert odd.stats().num_total_blocks == 32 and odd.max_model_len == 500
    with pytest.raises(ValueError, match="hold no block"):
        LLMEngine(model, None, EngineConfig(kv_cache_memory=block - 1))


def _others() -> int:
    """What engines other tests left alive hold on the emulated device (a server's engine lives on after its app
    as long as FastAPI's caches keep its route functions): the device rule counts them, as a GPU would."""
    return CPU_DEVICE.held_bytes(torch.device("cpu"))


def _device_rule_config() -> EngineConfig:
    """An emulated CPU device of 8 MiB beyond what other engines hold, smaller than what 32 sequences of 512 tokens
    could use (16 MiB)."""
    return EngineConfig(cpu_device_memory=(8 << 20) + int(_others() / 0.9), max_num_seqs=32,
                        max_num_batched_tokens=64)


def test_cpu_budget_follows_the_device_rule(tiny_pairs) -> None:
    """Pool = device memory x utilization - weights - activations - what live engines hold."""
    model, _ = tiny_pairs["llama3"]
    config = _device_rule_config()
    held = CPU_DEVICE.held_bytes(torch.device("cpu"), besides=[model])  # this model's weights, and the others'
    engine = LLMEngine(model, None, config)
    expected = int(config.cpu_device_memory * 0.9) - held - activation_bytes(model, config)
    assert engine.kv_cache.nbytes == expected // kv_block_bytes(model.config, 16, model.dtype) * \
        kv_block_bytes(model.config, 16, model.dtype)
    engine.shutdown()


def test_a_second_engine_fails_while_the_first_holds_its_pool_and_passes_once_it_is_released(tiny_pairs) -> None:
    """The lesson-style sequence: engine A alive, then engine B. As on a GPU, B finds no memory until A
    is shut down (or no longer referenced); the error says what to do."""
    model, _ = tiny_pairs["llama3"]
    config = _device_rule_config()  # measured once: each engine then draws on the same device
    first = LLM.from_model(model, None, **vars(config))
    with pytest.raises(RuntimeError, match="no device memory left.*shutdown"):
        LLMEngine(model, None, config)
    first.shutdown()
    assert first.llm_engine.kv_cache.nbytes == 0
    with pytest.raises(EngineDeadError, match="shut down"):
        first.generate([[5, 6, 7]], use_tqdm=False)
    with LLM.from_model(model, None, **vars(config)) as second:  # the memory is back
        assert second.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)[0].finished
    assert second.llm_engine.kv_cache.nbytes == 0  # the context manager shut it down
    third = LLMEngine(model, None, config)
    del third  # an engine nobody references holds nothing either
    LLMEngine(model, None, config).shutdown()


def test_an_explicit_budget_lets_two_engines_live_side_by_side(tiny_pairs) -> None:
    model, _ = tiny_pairs["llama3"]
    half = EngineConfig(cpu_device_memory=8 << 20, kv_cache_memory=3 << 20)
    first, second = LLMEngine(model, None, half), LLMEngine(model, None, half)
    assert first.kv_cache.nbytes == second.kv_cache.nbytes > 0
    first.shutdown()
    second.shutdown()


def test_a_played_gpu_s_memory_limits_weights_activations_and_an_explicit_pool(tiny_pairs, monkeypatch) -> None:
    """Under LLM_RUNTIME_DEVICE_PROFILE the GPU's own memory is a second limit: a pool asked for explicitly that
    would not fit beside the weights and activations in a (here, shrunk) T4 is refused; one that fits is built;
    the CPU's own profile has no such limit."""
    from dataclasses import replace as replace_profile

    from llm_runtime.device import EMULATED_PROFILES

    model, _ = tiny_pairs["llama3"]
    block = kv_block_bytes(model.config, 16, model.dtype)
    held = (CPU_DEVICE.held_bytes(torch.device("cpu"), besides=[model])
            + activation_bytes(model, EngineConfig(num_kv_blocks=1)))  # other tests' live engines too (`_others`)
    t4 = replace_profile(EMULATED_PROFILES["t4"], memory_bytes=int((held + 100 * block) / 0.9))
    monkeypatch.setitem(EMULATED_PROFILES, "t4", t4)
    monkeypatch.setenv("LLM_RUNTIME_DEVICE_PROFILE", "t4")
    with pytest.raises(RuntimeError, match="out of memory on a T4.*played by the CPU.*smaller pool"):
        LLMEngine(model, None, EngineConfig(num_kv_blocks=200))
    with pytest.raises(RuntimeError, match="out of memory on a T4"):
        LLMEngine(model, None, EngineConfig(kv_cache_memory=200 * block))
    LLMEngine(model, None, EngineConfig(num_kv_blocks=90)).shutdown()
    monkeypatch.delenv("LLM_RUNTIME_DEVICE_PROFILE")
    LLMEngine(model, None, EngineConfig(num_kv_blocks=200)).shutdown()


@pytest.mark.parametrize("config", [dict(block_size=0), dict(num_kv_blocks=0), dict(kv_cache_memory=-1),
                                    dict(gpu_memory_utilization=0), dict(gpu_memory_utilization=1.5),
                                    dict(num_kv_blocks=True), dict(cpu_device_memory=0)])
def test_memory_config_is_validated(config: dict) -> None:
    with pytest.raises(ValueError):
        EngineConfig(**config)


@pytest.mark.slow
def test_bundled_model_under_pressure_equals_transformers(bundled, bundled_reference) -> None:
    """Float32, the real model: a shared chat system prompt, n = 2, and a pool that forces preemption."""
    model, tokenizer = bundled
    llm = LLM.from_model(model, tokenizer, max_num_seqs=8, max_num_batched_tokens=128, block_size=16,
                         num_kv_blocks=24)
    system = "You are a concise assistant who answers questions about geography and science."
    questions = ["What is the capital of France?", "Why is the sky blue?", "Name a large river.",
                 "How far is the Moon?", "What is photosynthesis?", "Where is Mount Everest?"]
    prompts = [encode_chat(tokenizer, [{"role": "system", "content": system}, {"role": "user", "content": q}])
               for q in questions]
    params = [SamplingParams(n=2 if i % 3 == 0 else 1, temperature=0, max_tokens=20, ignore_eos=True)
              for i in range(len(prompts))]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output, p in zip(prompts, outputs, params):
        expected = transformers_greedy(bundled_reference, prompt, 20)
        assert [c.token_ids for c in output.outputs] == [expected] * p.n
    stats = llm.llm_engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hit_tokens > 0
    assert stats.num_free_blocks == stats.num_total_blocks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_budget_is_profiled_within_the_utilization(bundled, bundled_reference) -> None:
    model, tokenizer = bundled
    model = model.to("cuda")
    try:
        llm = LLM.from_model(model, tokenizer, gpu_memory_utilization=0.5)
        _, total = torch.cuda.mem_get_info()
        assert 0 < llm.llm_engine.kv_cache.nbytes <= 0.5 * total
        assert torch.cuda.memory_allocated() <= 0.5 * total
        prompt = tokenizer.encode("The capital of France is")
        output = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=8,
                                                                             ignore_eos=True), use_tqdm=False)
        assert output[0].outputs[0].token_ids == transformers_greedy(bundled_reference, prompt, 8)
    finally:
        model.to("cpu")


def test_shutdown_aborts_live_requests_and_refuses_new_ones(tiny_pairs) -> None:
    model, _ = tiny_pairs["llama2"]
    engine = LLMEngine(model, None, EngineConfig(num_kv_blocks=16))
    engine.add_request("live", [5, 6, 7, 8], SamplingParams(max_tokens=50))
    engine.step()
    engine.shutdown()
    assert not engine.has_unfinished_requests() and engine.kv_cache.nbytes == 0
    with pytest.raises(EngineDeadError):
        engine.add_request("late", [5, 6], SamplingParams(max_tokens=2))
    engine.shutdown()  # twice is harmless
