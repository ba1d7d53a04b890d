"""An int8 pool's scales: each layer's key (turned back by the rotary embedding) and value ranges as the
model writes them, the same at every position; the engine calibrates once, before the first request;
quality on the bundled model."""

from __future__ import annotations

import copy

import pytest
import torch

from llm_runtime.attention import ContiguousKVCache
from llm_runtime.attention.kv_calibration import (
    CALIBRATION_TEXT,
    HEADROOM,
    KVRangeObserver,
    calibrate_kv_scales,
    calibration_token_ids,
)
from llm_runtime.attention.kv_quant import KeyTurns
from llm_runtime.bench.quality import compare, eval_text
from llm_runtime.config import EngineConfig
from llm_runtime.engine import LLMEngine
from llm_runtime.sampling import SamplingParams


def test_the_observer_sees_the_keys_and_values_the_cache_would_store(tiny_pairs) -> None:
    """Keys turned back by the rotary embedding, values as they are, and the first token's values."""
    model = copy.deepcopy(tiny_pairs["llama3"][0]).float()
    ids = torch.randint(3, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(40)[None]
    turns = KeyTurns.of(model.config.rope, model.config.head_dim)
    observer = KVRangeObserver(model.config.num_layers, turns)
    with torch.inference_mode():
        observed = model.compute_logits(model(ids, observer, positions))
        cache = ContiguousKVCache.for_model(model.config, 1, 40, dtype=torch.float32, device="cpu")
        stored = model.compute_logits(model(ids, cache, positions))
    assert torch.allclose(observed, stored, atol=1e-5)  # it attends as a cache does
    for layer in range(model.config.num_layers):
        keys = turns.turn(cache.keys[layer][0].transpose(0, 1), positions[0], back=True)  # (T, KV, d)
        values = cache.values[layer][0]  # (KV, T, d)
        assert torch.allclose(observer.key_low[layer], keys.amin(0)) and torch.allclose(observer.key_high[layer], keys.amax(0))
        assert torch.equal(observer.value_low[layer], values.amin(1))
        assert torch.equal(observer.value_high[layer], values.amax(1))
        assert torch.equal(observer.first_values[layer][0][0], values[:, 0])
    scales = observer.scales()
    span = observer.key_high[0] - observer.key_low[0]
    assert torch.allclose(scales.keys[0].scale * 254, span * HEADROOM)
    assert torch.allclose(scales.keys[0].zero, (observer.key_high[0] + observer.key_low[0]) / 2)
    # Values: the same steps, moved by at most half of one so that the first token's value is one of them.
    value, first = scales.values[1], observer.first_values[1][0][0]
    middle = (observer.value_high[1] + observer.value_low[1]) / 2
    assert torch.allclose(value.scale * 254, (observer.value_high[1] - observer.value_low[1]) * HEADROOM)
    assert ((value.zero - middle).abs() <= value.scale / 2 + 1e-6).all()
    steps = (first - value.zero) / value.scale
    assert torch.allclose(steps, steps.round(), atol=1e-3)
    with pytest.raises(ValueError, match="seen no tokens"):
        KVRangeObserver(2, turns).scales()


def test_keys_turned_back_are_the_same_wherever_the_text_sits_in_the_context(tiny_pairs) -> None:
    """As the model turns them, the same text's keys change with its position (a range measured at the start
    misses them 4,000 positions on); turned back, they do not: one range serves every position."""
    model = copy.deepcopy(tiny_pairs["llama3"][0]).float()
    ids = torch.randint(3, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(1))
    turns = KeyTurns.of(model.config.rope, model.config.head_dim)
    keys = {}
    with torch.inference_mode():
        for start in (0, 4064):
            cache = ContiguousKVCache.for_model(model.config, 1, 32, dtype=torch.float32, device="cpu")
            positions = torch.arange(start, start + 32)
            model(ids, cache, positions[None])
            turned = cache.keys[0][0].transpose(0, 1)  # (T, KV, d) as the model turned them
            keys[start] = turned, turns.turn(turned, positions, back=True)
    (near_turned, near_back), (far_turned, far_back) = keys[0], keys[4064]
    assert (far_turned.amax(0) > near_turned.amax(0) + 0.1).any()  # outside the range measured near the start
    assert torch.allclose(far_back, near_back, atol=1e-3)
    with pytest.raises(ValueError, match="at least one token"):
        calibrate_kv_scales(model, [])


def test_the_engine_calibrates_an_int8_pool_once_and_serves_with_it(tiny_pairs) -> None:
    model = copy.deepcopy(tiny_pairs["qwen3"][0]).float()
    engine = LLMEngine(model, None, EngineConfig(kv_cache_dtype="int8", num_kv_blocks=32, block_size=4,
                                                 max_model_len=64))
    expected = calibrate_kv_scales(model, calibration_token_ids(None, model.config.vocab_size))
    assert torch.equal(engine.kv_cache.kv_scales.keys[1].scale, expected.keys[1].scale)
    engine.add_request("a", {"prompt_token_ids": [5, 6, 7, 8, 9]}, SamplingParams(temperature=0, max_tokens=6))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv_cache.kv_scales.keys[1].scale is not None  # unchanged by serving
    assert torch.equal(engine.kv_cache.kv_scales.keys[1].scale, expected.keys[1].scale)
    fp8 = LLMEngine(model, None, EngineConfig(kv_cache_dtype="fp8", num_kv_blocks=32, block_size=4))
    assert fp8.kv_cache.kv_scales is None


def test_the_calibration_text_ships_with_the_package_and_is_not_the_evaluation_text() -> None:
    text = CALIBRATION_TEXT.read_text()
    assert len(text.split()) > 1000 and not set(text.split("\n\n")) & set(eval_text().split("\n\n"))


@pytest.mark.slow
def test_the_bundled_model_with_an_int8_pool_agrees_with_float32(bundled) -> None:
    """Lesson 13's measure, on the first 512 tokens of the shipped text, with the scales an engine uses (the
    same for any context): 98.4 % top-1, KL 0.00035 when written."""
    model, tokenizer = bundled
    ids = tokenizer.encode(eval_text())[:513]
    scales = calibrate_kv_scales(model, calibration_token_ids(tokenizer, model.config.vocab_size))
    report = compare(model, model, ids, kv_cache_dtype="int8", kv_scales=scales)
    assert report.top1_agreement >= 0.975 and report.kl_divergence < 0.001
    with pytest.raises(ValueError, match="needs kv_scales"):
        compare(model, model, ids[:20], kv_cache_dtype="int8")
