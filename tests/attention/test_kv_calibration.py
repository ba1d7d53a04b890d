"""An int8 pool's scales: each layer's key and value ranges as the model writes them, over windows spread
across the context; the engine calibrates once, before the first request; quality on the bundled model."""

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
    window_starts,
)
from llm_runtime.bench.quality import compare, eval_text
from llm_runtime.config import EngineConfig
from llm_runtime.engine import LLMEngine
from llm_runtime.sampling import SamplingParams


def test_the_observer_sees_the_keys_and_values_the_cache_would_store(tiny_pairs) -> None:
    model = copy.deepcopy(tiny_pairs["llama3"][0]).float()
    ids = torch.randint(3, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(100, 140)[None]
    observer = KVRangeObserver(model.config.num_layers)
    with torch.inference_mode():
        observed = model.compute_logits(model(ids, observer, positions))
        cache = ContiguousKVCache.for_model(model.config, 1, 40, dtype=torch.float32, device="cpu")
        stored = model.compute_logits(model(ids, cache, positions))  # keys turned for positions 100 .. 139
    assert torch.allclose(observed, stored, atol=1e-5)  # it attends as a cache does
    for layer in range(model.config.num_layers):
        keys = cache.keys[layer][0]  # (KV, T, d)
        values = cache.values[layer][0]
        assert torch.equal(observer.key_low[layer], keys.amin(1)) and torch.equal(observer.key_high[layer], keys.amax(1))
        assert torch.equal(observer.value_low[layer], values.amin(1))
        assert torch.equal(observer.value_high[layer], values.amax(1))
    scales = observer.scales()
    span = observer.key_high[0] - observer.key_low[0]
    assert torch.allclose(scales.keys[0].scale * 254, span * HEADROOM)
    assert torch.allclose(scales.keys[0].zero, (observer.key_high[0] + observer.key_low[0]) / 2)
    with pytest.raises(ValueError, match="seen no tokens"):
        KVRangeObserver(2).scales()


def test_windows_are_spread_across_the_context() -> None:
    assert window_starts(5, 8192, 256) == [0, 1984, 3968, 5952, 7936]  # the last ends at 8192
    assert window_starts(1, 8192, 256) == [0]
    assert window_starts(3, 100, 256) == [0, 0, 0]  # a context shorter than a window


def test_keys_far_into_the_context_fall_outside_a_range_measured_near_its_start(tiny_pairs) -> None:
    """The rotary embedding turns keys with the position, not values: windows at the context's start leave
    a far window's keys out of range, windows spread across it do not; values are the same either way."""
    model = copy.deepcopy(tiny_pairs["llama3"][0]).float()
    ids = torch.randint(3, model.config.vocab_size, (96,), generator=torch.Generator().manual_seed(1)).tolist()
    near = calibrate_kv_scales(model, ids, max_position=96, window=32, headroom=1.0)  # windows at 0, 32, 64
    far = calibrate_kv_scales(model, ids, max_position=4096, window=32, headroom=1.0)  # at 0, 2032, 4064
    observer = KVRangeObserver(model.config.num_layers)
    with torch.inference_mode():  # the last window alone, where `far` put it
        model(torch.tensor([ids[64:]]), observer, torch.arange(4064, 4096)[None])
    for scales, covered in ((far, True), (near, False)):
        key = scales.keys[0]
        high, low = key.zero + 127 * key.scale, key.zero - 127 * key.scale
        inside = (observer.key_high[0] <= high + 1e-5).all() and (observer.key_low[0] >= low - 1e-5).all()
        assert bool(inside) == covered
    for layer in range(model.config.num_layers):  # attention sees relative positions only: values alike
        assert torch.allclose(far.values[layer].scale, near.values[layer].scale, atol=1e-5)
        assert torch.allclose(far.values[layer].zero, near.values[layer].zero, atol=1e-5)
    with pytest.raises(ValueError, match="at least one token"):
        calibrate_kv_scales(model, [])


def test_the_engine_calibrates_an_int8_pool_once_and_serves_with_it(tiny_pairs) -> None:
    model = copy.deepcopy(tiny_pairs["qwen3"][0]).float()
    engine = LLMEngine(model, None, EngineConfig(kv_cache_dtype="int8", num_kv_blocks=32, block_size=4,
                                                 max_model_len=64))
    expected = calibrate_kv_scales(model, calibration_token_ids(None, model.config.vocab_size), max_position=64)
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
    """Lesson 13's measure: top-1 agreement over the shipped text with scales calibrated for a context
    of 2,048 positions (98.3 % when written)."""
    model, tokenizer = bundled
    ids = tokenizer.encode(eval_text())[:513]
    scales = calibrate_kv_scales(model, calibration_token_ids(tokenizer, model.config.vocab_size), max_position=2048)
    report = compare(model, model, ids, kv_cache_dtype="int8", kv_scales=scales)
    assert report.top1_agreement >= 0.97 and report.kl_divergence < 0.003
    with pytest.raises(ValueError, match="needs kv_scales"):
        compare(model, model, ids[:20], kv_cache_dtype="int8")
