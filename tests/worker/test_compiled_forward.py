"""The forward pass as one compiled graph (worker/compiled_forward.py): the eager engine's tokens through
batching, paging, prefix hits, forks and preemption; one graph for every step shape; the steps it leaves
eager; quantized and packed layers inside it; when it is used by default and when it is refused.

The models are tiny and float32 (the `cpu` backend's C kernel reads float32 and bfloat16 pools): there, the
graph's fused pointwise loops compute what the eager operations compute, and greedy tokens agree.
"""

from __future__ import annotations

import copy

import pytest
import torch

from llm_runtime import EngineConfig, LLMEngine, SamplingParams
from llm_runtime.attention import available_backends
from llm_runtime.worker.compiled_forward import model_kind
from llm_runtime.model.packed_linear import pack_linears_
from llm_runtime.model.quantized_embedding import Q8Embedding, Q8Head, Q8Table
from llm_runtime.model.quantized_linear import quantize_linears_

from workloads import BLOCK_SIZE, assert_no_leak, blocks_unconstrained, run_all, shared_prefix_workload

pytestmark = pytest.mark.skipif(available_backends("cpu", torch.float32)["cpu"] is not None,
                                reason="no C compiler builds the cpu backend's kernel here")


def _config(**options) -> EngineConfig:
    """An engine's config without the native step: the short steps it would take (lesson 19) are what this file
    runs through the compiled graph."""
    return EngineConfig(native_step=False, **options)


def _float32(tiny_pairs, family: str = "qwen3") -> torch.nn.Module:
    return copy.deepcopy(tiny_pairs[family][0]).float()


def _pressed(model, workload, **options) -> EngineConfig:
    """A pool small enough for preemption, with prefix caching on."""
    largest = max(-(-(len(prompt) + p.max_tokens) // BLOCK_SIZE) for prompt, p in workload)
    return _config(max_num_seqs=16, max_num_batched_tokens=128, block_size=BLOCK_SIZE,
                   num_kv_blocks=max(blocks_unconstrained(workload) * 15 // 100, largest),
                   enable_prefix_caching=True, **options)


def _graphs_compiled() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def test_compiled_steps_give_the_eager_tokens_with_one_graph(tiny_pairs) -> None:
    """24 requests with shared prefixes under a small pool: prefill chunks, decodes of every batch size,
    prefix hits, forks and preemption. The compiled engine gives the eager engine's greedy tokens, compiles
    at most one graph when it is built (none if this process compiled one for such a model already) and
    none while it serves, and leaks no block."""
    model = _float32(tiny_pairs)
    workload = shared_prefix_workload(model.config.vocab_size, num_requests=24, seed=2)
    tokens, stats = {}, {}
    for compiled in (False, True):
        before = _graphs_compiled()
        engine = LLMEngine(model, None, _pressed(model, workload, compile_model=compiled))
        assert _graphs_compiled() - before <= int(compiled)  # compiled when built, by the warm-up
        built = _graphs_compiled()
        with torch._dynamo.config.patch(error_on_recompile=True):  # a new step shape must not recompile
            tokens[compiled] = run_all(engine, workload, arrive_every=1)
        assert _graphs_compiled() == built
        stats[compiled] = engine.stats()
        assert_no_leak(engine)
    assert tokens[True] == tokens[False]
    assert stats[True].compiled_model and stats[True].num_compiled_steps > 20
    assert stats[True].num_preemptions > 0 and stats[True].prefix_cache_hit_tokens > 0
    assert not stats[False].compiled_model and stats[False].num_compiled_steps == 0


def test_verification_chunks_run_in_the_same_graph(tiny_pairs) -> None:
    """Speculative decoding (lesson 14): k + 1 tokens per speculating sequence and k + 1 logits rows, in the
    graph already compiled; the eager engine's greedy tokens, no recompilation."""
    from workloads import NGRAM, repetitive_workload

    model = _float32(tiny_pairs)
    workload = repetitive_workload(model.config.vocab_size, 12, seed=3)
    expected = run_all(LLMEngine(model, None, _pressed(model, workload)), workload, arrive_every=1)
    engine = LLMEngine(model, None, _pressed(model, workload, compile_model=True, speculative_config=NGRAM))
    built = _graphs_compiled()
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert run_all(engine, workload, arrive_every=1) == expected
    assert _graphs_compiled() == built
    stats = engine.stats()
    assert stats.num_compiled_steps > 10 and stats.num_accepted_tokens > 10
    assert_no_leak(engine)


def test_long_chunks_and_prompt_logprobs_run_eagerly(tiny_pairs) -> None:
    """A step with a prefill chunk the kernel does not take (here: more than 8 rows), or a request that wants
    prompt logprobs, runs eagerly; the others compiled; tokens and logprobs are the eager engine's."""
    model = _float32(tiny_pairs, "llama3")
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=generator).tolist() for n in (5, 30, 7)]
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with_logprobs = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    results, steps = {}, {}
    for compiled in (False, True):
        engine = LLMEngine(model, None, _config(num_kv_blocks=32, compile_model=compiled))
        engine.attention_backend.kernel_max_rows = 8  # a 30-token prompt in one chunk goes block-wise
        for i, (prompt, params) in enumerate(zip(prompts, (plain, plain, with_logprobs))):
            engine.add_request(str(i), prompt, params)
        outputs, num_steps = {}, 0
        while engine.has_unfinished_requests():
            outputs.update({o.request_id: o for o in engine.step() if o.finished})
            num_steps += 1
        results[compiled] = {i: (o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs)
                             for i, o in outputs.items()}
        steps[compiled] = (num_steps, engine.stats().num_compiled_steps)
    eager_tokens = {i: r[0] for i, r in results[False].items()}
    assert {i: r[0] for i, r in results[True].items()} == eager_tokens
    for i in results[True]:
        for ours, theirs in zip(results[True][i][1:], results[False][i][1:]):
            if ours is not None or theirs is not None:
                for a, b in zip(ours, theirs):
                    if a is not None:
                        assert a.keys() == b.keys()
                        assert all(abs(a[t] - b[t]) < 1e-4 for t in a)
    num_steps, num_compiled = steps[True]
    assert 0 < num_compiled < num_steps  # the first step (a 30-token chunk, prompt logprobs) ran eagerly


def _q8_tied_head_(model) -> None:
    """The model's tied embedding as a Q8_0 table (int8 per 32 columns with a scale), for lookup and head."""
    weight = model.model.embed_tokens.weight.detach().float()  # (vocab, hidden)
    blocks = weight.reshape(weight.shape[0], -1, 32)
    d = blocks.abs().amax(-1).clamp(min=1e-8) / 127  # (vocab, hidden / 32)
    q = (blocks / d[..., None]).round().clamp(-127, 127).to(torch.int8).reshape(weight.shape)
    table = Q8Table(q, d, torch.float32)
    model.model.embed_tokens, model.lm_head = Q8Embedding(table), Q8Head(table)


@pytest.mark.parametrize("layers", ["packed", "int8", "int8 in groups", "int4 and a Q8_0 head"])
def test_packed_and_quantized_layers_inside_the_graph(tiny_pairs, layers: str) -> None:
    """oneDNN's packed product and the quantized products are operators of this package's inside the graph
    (`packed_linear`, `int4_matmul`, `q8_matmul_t`; PyTorch's int8 kernel directly): the same tokens as eager."""
    model = _float32(tiny_pairs, "smollm2")  # a tied head
    if layers == "packed":
        pack_linears_(model)
    elif layers == "int8":
        quantize_linears_(model, "int8", dtype=torch.float32)
    elif layers == "int8 in groups":  # the Q8_0 table's operator with a minimum
        quantize_linears_(model, "int8", group_size=32, dtype=torch.float32)
    else:
        _q8_tied_head_(model)
        quantize_linears_(model, "int4", dtype=torch.float32)
    workload = shared_prefix_workload(model.config.vocab_size, num_requests=10, seed=4)
    tokens = {}
    for compiled in (False, True):
        engine = LLMEngine(model, None, _config(max_num_seqs=8, num_kv_blocks=64, block_size=BLOCK_SIZE,
                                                compile_model=compiled))
        tokens[compiled] = run_all(engine, workload)
        assert engine.stats().num_compiled_steps > 0 or not compiled
    assert tokens[True] == tokens[False]


def test_engines_share_the_graph_each_over_its_own_pool(tiny_pairs) -> None:
    """Two live engines on one model, with pools of different sizes: the second finds the first's graph (no
    new compile), and each steps over its own pool (tokens as the eager engine's, the pools written apart)."""
    model = _float32(tiny_pairs, "llama3")
    prompts = [[5, 6, 7, 8, 9], [20, 21, 22]]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    first = LLMEngine(model, None, _config(num_kv_blocks=16, compile_model=True))
    before = _graphs_compiled()
    second = LLMEngine(model, None, _config(num_kv_blocks=24, compile_model=True))
    assert _graphs_compiled() == before
    for engine, prompt in ((first, prompts[0]), (second, prompts[1])):
        engine.add_request("0", prompt, params)
    outputs = {}
    while first.has_unfinished_requests() or second.has_unfinished_requests():
        for name, engine in (("first", first), ("second", second)):
            outputs.update({name: o.outputs[0].token_ids for o in engine.step() if o.finished})
    eager = LLMEngine(model, None, _config(num_kv_blocks=16))
    expected = run_all(eager, [(prompt, params) for prompt in prompts])
    assert ([outputs["first"]], [outputs["second"]]) == (expected["0"], expected["1"])
    assert first.stats().num_compiled_steps == second.stats().num_compiled_steps == 10


def test_a_model_of_another_kind_gets_its_own_graph(tiny_pairs) -> None:
    """The graph skips the guards on the modules, so a model that differs in anything a trace reads (here only
    its norms' epsilon, a constant in the graph) must get a graph of its own: each gives its eager tokens."""
    model = _float32(tiny_pairs, "llama3")
    same, other = copy.deepcopy(model), copy.deepcopy(model)
    for module in other.modules():
        if hasattr(module, "eps"):
            module.eps = 0.5  # large enough to change the tokens
    assert model_kind(same) == model_kind(model) != model_kind(other)
    prompts = [([5, 6, 7, 8, 9], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))]
    tokens = {}
    for name, candidate in (("model", model), ("other", other), ("same", same)):
        for compiled in (True, False):
            engine = LLMEngine(candidate, None, _config(num_kv_blocks=16, compile_model=compiled))
            tokens[name, compiled] = run_all(engine, prompts)
            assert engine.stats().num_compiled_steps == (8 if compiled else 0)
    assert tokens["model", True] == tokens["model", False] == tokens["same", True]
    assert tokens["other", True] == tokens["other", False] != tokens["model", False]


def test_compiled_by_default_only_for_an_owned_cpu_model(tiny_pairs) -> None:
    model = _float32(tiny_pairs, "llama2")
    assert not LLMEngine(model, None, _config(num_kv_blocks=8)).stats().compiled_model  # a model passed in
    owned = LLMEngine(copy.deepcopy(model), None, _config(num_kv_blocks=8), owns_model=True)
    assert owned.stats().compiled_model
    for options in ({"enforce_eager": True}, {"compile_model": False}, {"kv_cache_dtype": "int8"},
                    {"attention_backend": "blockwise"}):
        engine = LLMEngine(copy.deepcopy(model), None, _config(num_kv_blocks=8, **options), owns_model=True)
        assert not engine.stats().compiled_model, options
    float64 = tiny_pairs["llama2"][0]  # the cpu backend reads float32 and bfloat16: block-wise, eager
    assert not LLMEngine(float64, None, _config(num_kv_blocks=8), owns_model=True).stats().compiled_model


def test_a_cpu_playing_a_gpu_compiles_only_when_asked(tiny_pairs, monkeypatch) -> None:
    """Under LLM_RUNTIME_DEVICE_PROFILE the engine does by itself what the GPU would: no CPU forward compile."""
    model = _float32(tiny_pairs, "llama2")
    monkeypatch.setenv("LLM_RUNTIME_DEVICE_PROFILE", "h100")
    played = LLMEngine(copy.deepcopy(model), None, _config(num_kv_blocks=8), owns_model=True)
    assert not played.stats().compiled_model
    asked = LLMEngine(copy.deepcopy(model), None, _config(num_kv_blocks=8, compile_model=True), owns_model=True)
    assert asked.stats().compiled_model


def test_compiling_is_refused_where_it_cannot_run(tiny_pairs) -> None:
    model = _float32(tiny_pairs, "llama2")
    with pytest.raises(ValueError, match="blockwise attention backend does not run inside a compiled"):
        LLMEngine(model, None, _config(num_kv_blocks=8, compile_model=True, attention_backend="blockwise"))
    with pytest.raises(ValueError, match="8-bit KV pool"):
        LLMEngine(model, None, _config(num_kv_blocks=8, compile_model=True, kv_cache_dtype="int8"))
    with pytest.raises(ValueError, match="enforce_eager"):
        EngineConfig(compile_model=True, enforce_eager=True)
    with pytest.raises(ValueError, match="compile_pointwise"):
        EngineConfig(compile_model=True, compile_pointwise=True)
    with pytest.raises(ValueError, match="compile_model must be True, False or None"):
        EngineConfig(compile_model="yes")
