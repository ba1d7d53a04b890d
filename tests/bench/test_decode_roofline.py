"""Batch-1 decode against the roofline: the modes run, the arithmetic holds, bad modes are refused."""

from __future__ import annotations

import copy

import pytest
import torch

from llm_runtime.__main__ import main
from llm_runtime.bench.decode_roofline import measure, table
from llm_runtime.bench.roofline import weight_bytes


def test_each_mode_is_measured_against_the_weights_over_the_bandwidth(tiny_pairs) -> None:
    model = copy.deepcopy(tiny_pairs["llama3"][0]).float()
    results = measure(model, ["eager", "compiled"], prompt_len=5, num_steps=4)
    assert [r.mode for r in results] == ["eager", "compiled"]
    for r in results:
        assert r.weight_mb == pytest.approx(weight_bytes(model.config, 4) / 1e6)
        assert r.roofline_ms == pytest.approx(r.weight_mb * 1e6 / (r.bandwidth_gb_s * 1e9) * 1e3)
        assert r.roofline_fraction == pytest.approx(r.roofline_ms / r.step_ms)
        assert r.tokens_per_s == pytest.approx(1e3 / r.step_ms)
    assert "| compiled |" in table(results)


@pytest.fixture
def tiny_loaded(tiny_pairs, monkeypatch):
    """The command loads the first tiny model whatever it is asked for (tiny checkpoints have no tokenizer)."""
    model = copy.deepcopy(tiny_pairs["llama3"][0]).float()
    monkeypatch.setattr("llm_runtime.model.load_model", lambda *args, **kwargs: (model, None))
    return model


def test_bad_modes_are_refused(tiny_loaded, capsys) -> None:
    model = tiny_loaded
    with pytest.raises(ValueError, match="unknown mode"):
        measure(model, ["fast"])
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            measure(model, ["graphs"])
    assert main(["roofline", "--modes", "turbo"]) == 2
    assert "unknown mode" in capsys.readouterr().err


def test_the_command_writes_its_table(tiny_loaded, tmp_path, capsys) -> None:
    assert main(["roofline", "--modes", "eager", "--num-steps", "3", "--output-dir", str(tmp_path)]) == 0
    assert "| eager |" in capsys.readouterr().out
    assert (tmp_path / "roofline.json").exists() and (tmp_path / "roofline.md").exists()


def test_engines_stepped_in_turn_are_each_timed_and_left_idle(tiny_pairs) -> None:
    from llm_runtime import EngineConfig, LLMEngine
    from llm_runtime.bench.decode_roofline import interleaved_step_seconds

    model = copy.deepcopy(tiny_pairs["llama3"][0]).float()
    engines = {name: LLMEngine(model, None, EngineConfig(num_kv_blocks=8, attention_backend=backend))
               for name, backend in (("a", "torch-gather"), ("b", "blockwise"))}
    seconds = interleaved_step_seconds(engines, prompt_len=5, num_steps=3, warmup=1)
    assert set(seconds) == {"a", "b"} and all(s > 0 for s in seconds.values())
    assert not any(engine.has_unfinished_requests() for engine in engines.values())
    assert all(engine.stats().num_free_blocks == 8 for engine in engines.values())
