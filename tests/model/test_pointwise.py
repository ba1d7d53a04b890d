"""The layers' pointwise parts: compiled (torch.compile) equal to eager to float tolerance over step sizes
without a recompilation per size, and an engine with them compiled gives the same greedy tokens."""

from __future__ import annotations

import copy

import pytest
import torch

from llm_runtime import LLM, EngineConfig, LLMEngine, SamplingParams
from llm_runtime.model.pointwise import EAGER_OPS, compiled_ops, pointwise_ops_of, set_pointwise_ops_


def test_compiled_ops_equal_eager_ones_over_many_step_sizes() -> None:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = compiled_ops()
    generator = torch.Generator().manual_seed(0)
    with torch._dynamo.config.patch(error_on_recompile=False):
        for rows in (5, 17, 64, 200):  # dynamic shapes: sizes past the first reuse the compiled kernel
            x = torch.randn(1, rows, 48, generator=generator)
            weight = torch.randn(48, generator=generator)
            torch.testing.assert_close(compiled.rms_norm(x, weight, 1e-6), EAGER_OPS.rms_norm(x, weight, 1e-6))
            gate, up = torch.randn(2, 1, rows, 96, generator=generator)
            torch.testing.assert_close(compiled.silu_and_mul(gate, up), EAGER_OPS.silu_and_mul(gate, up))
            q = torch.randn(1, 4, rows, 16, generator=generator)
            cos, sin = torch.randn(2, 1, rows, 16, generator=generator)
            torch.testing.assert_close(compiled.rotary(q, cos, sin), EAGER_OPS.rotary(q, cos, sin))
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert frames <= 6, f"{frames} graphs compiled for 3 functions: the step size should not recompile each time"


def test_an_engine_with_compiled_ops_gives_the_same_greedy_tokens(tiny_pairs) -> None:
    model = copy.deepcopy(tiny_pairs["llama3"][0])  # float64
    prompts = [[(7 * i + j) % model.config.vocab_size for j in range(3 + 5 * i)] for i in range(5)]
    params = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)

    def tokens(**options) -> list[list[int]]:
        with LLM.from_model(model, None, num_kv_blocks=64, **options) as llm:
            assert llm.llm_engine.stats().pointwise_ops == ("compiled" if options else "eager")
            return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    eager = tokens()
    assert tokens(compile_pointwise=True) == eager
    assert pointwise_ops_of(copy.deepcopy(model)) is pointwise_ops_of(model)  # a copy runs the same compiled ops
    # An engine that asks for eager gets it, on a model an earlier engine compiled; one that does not say keeps it.
    assert pointwise_ops_of(model).name == "compiled"
    assert LLMEngine(model, None, EngineConfig(num_kv_blocks=8)).stats().pointwise_ops == "compiled"
    assert LLMEngine(model, None, EngineConfig(num_kv_blocks=8, enforce_eager=True)).stats().pointwise_ops == "eager"
    set_pointwise_ops_(model, compiled_ops())
    assert LLMEngine(model, None, EngineConfig(num_kv_blocks=8, compile_pointwise=False)).stats().pointwise_ops == "eager"


def test_enforce_eager_refuses_compilation_and_the_cpu_default_stays_eager(tiny_pairs) -> None:
    with pytest.raises(ValueError, match="enforce_eager"):
        EngineConfig(enforce_eager=True, compile_pointwise=True)
    model = copy.deepcopy(tiny_pairs["llama3"][0])
    engine = LLMEngine(model, None, EngineConfig(num_kv_blocks=8), owns_model=True)  # CPU: measured no faster
    assert engine.stats().pointwise_ops == "eager"
    engine.shutdown()
