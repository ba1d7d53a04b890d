"""The plan (worker/plan.py): every set-up choice made once, from the config, the model and the device profile, with
the reason for each; what the engine reports; what rank 0 sends the other ranks, checked on arrival."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from llm_runtime import EngineConfig, LLMEngine
from llm_runtime.executor.rank_processes import RankSetup
from llm_runtime.worker.plan import ModelPlan, choose_plan


def _model(tiny_pairs, family: str = "llama2") -> torch.nn.Module:
    return copy.deepcopy(tiny_pairs[family][0]).float()


def test_an_owned_cpu_model_is_packed_and_compiled_and_a_passed_in_one_left_alone(tiny_pairs) -> None:
    model = _model(tiny_pairs)
    owned = choose_plan(EngineConfig(native_step=False), model, owns_model=True)
    passed = choose_plan(EngineConfig(native_step=False), model, owns_model=False)
    assert (owned.prepack_weights, owned.compile_model) == (True, True)
    assert (passed.prepack_weights, passed.compile_model) == (False, False)
    assert passed.reason("compile_model") == passed.reason("prepack_weights") == "a model passed in is left as it is"
    assert not owned.cuda_graphs and owned.reason("cuda_graphs") == "CUDA graphs need a CUDA device, not cpu"
    assert owned.pointwise_ops == "as is" and owned.keep_freed_host_memory


def test_a_cpu_playing_an_h100_plans_as_the_gpu_would_where_the_plan_has_a_choice(tiny_pairs, monkeypatch) -> None:
    model = _model(tiny_pairs)
    cpu = choose_plan(EngineConfig(native_step=False), model, owns_model=True)
    monkeypatch.setenv("LLM_RUNTIME_DEVICE_PROFILE", "h100")
    h100 = choose_plan(EngineConfig(native_step=False), model, owns_model=True)
    assert cpu.compile_model and not h100.compile_model
    assert h100.reason("compile_model") == "not by itself on a H100, compute capability 9.0, played by the CPU"
    assert "H100" in h100.profile and cpu.profile == "the CPU"
    asked = choose_plan(EngineConfig(native_step=False, compile_model=True), model, owns_model=True)
    assert asked.compile_model and asked.reason("compile_model") == "asked"


def test_what_the_config_asks_for_and_cannot_run_is_refused_with_the_reason(tiny_pairs) -> None:
    model = _model(tiny_pairs)
    with pytest.raises(ValueError, match="cuda_graphs=True, but CUDA graphs need a CUDA device"):
        choose_plan(EngineConfig(cuda_graphs=True), model, owns_model=True)
    with pytest.raises(ValueError, match="compile_model=True, but the blockwise attention backend"):
        choose_plan(EngineConfig(compile_model=True, attention_backend="blockwise"), model, owns_model=True)


def test_the_engine_reports_its_plan_and_logs_it(tiny_pairs, caplog) -> None:
    model = _model(tiny_pairs)
    with caplog.at_level("INFO", logger="llm_runtime.engine.engine"):
        engine = LLMEngine(model, None, EngineConfig(num_kv_blocks=8, native_step=False))
    text = engine.stats().plan
    assert text == engine.plan.describe() and text in caplog.text
    for choice in ("attention_backend", "prepack_weights", "compile_model", "cuda_graphs", "native_step"):
        assert choice in text
    assert engine.stats().attention_backend == engine.plan.attention_backend
    engine.shutdown()


def test_rank_zeros_set_up_travels_as_json_and_anything_else_is_refused(tiny_pairs) -> None:
    plan = choose_plan(EngineConfig(native_step=False), _model(tiny_pairs), owns_model=True)
    setup = RankSetup(plan, num_blocks=12, max_model_len=96, kv_calibration=(1, 2, 3))
    assert RankSetup.from_json(setup.to_json()) == setup
    assert ModelPlan.from_json(plan.to_json()) == plan
    good = setup.to_json()
    for bad in ({**good, "extra": 1}, {**good, "num_blocks": True}, {**good, "num_blocks": -1},
                {**good, "kv_calibration": ["1"]}, {**good, "plan": {**good["plan"], "native_step": "yes"}},
                {**good, "plan": {**good["plan"], "pointwise_ops": "fast"}}, "not a dict"):
        with pytest.raises(RuntimeError):
            RankSetup.from_json(bad)
    assert dataclasses.replace(plan, reasons=()).describe().count("\n") == plan.describe().count("\n")
