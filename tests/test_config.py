"""ModelConfig: parsing Hugging Face configs of each family, and refusing what we cannot run."""

from __future__ import annotations

import pytest

from llm_runtime import ModelConfig, RopeConfig

BASE = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def test_family_switches() -> None:
    assert ModelConfig.from_hf({**BASE, "model_type": "qwen2"}).attention_bias
    assert not ModelConfig.from_hf({**BASE, "model_type": "llama"}).attention_bias
    qwen3 = ModelConfig.from_hf({**BASE, "model_type": "qwen3", "head_dim": 128})
    assert qwen3.qk_norm and qwen3.head_dim == 128
    assert ModelConfig.from_hf({**BASE, "model_type": "llama"}).head_dim == 16


def test_both_rope_spellings() -> None:
    old = {**BASE, "model_type": "llama", "rope_theta": 500000.0,
           "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    new = {**BASE, "model_type": "llama",
           "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192}}
    assert ModelConfig.from_hf(old).rope == ModelConfig.from_hf(new).rope
    assert ModelConfig.from_hf(new).rope == RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0)


def test_eos_ids_prefer_generation_config() -> None:
    config = ModelConfig.from_hf({**BASE, "model_type": "llama", "eos_token_id": 2},
                                 {"eos_token_id": [128001, 128009]})
    assert config.eos_token_ids == (128001, 128009)
    assert ModelConfig.from_hf({**BASE, "model_type": "llama", "eos_token_id": 2}).eos_token_ids == (2,)


@pytest.mark.parametrize(
    "change,match",
    [
        ({"model_type": "mistral"}, "unsupported architecture"),
        ({"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type"),
        ({"model_type": "llama", "num_key_value_heads": 3}, "multiple of num_kv_heads"),
        ({"model_type": "llama", "hidden_size": 0}, "hidden_size"),
        ({"model_type": "qwen2", "use_sliding_window": True}, "sliding"),
    ],
)
def test_refusals_name_the_problem(change: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf({**BASE, **change})


def test_kv_bytes_per_token_of_the_bundled_shape() -> None:
    smollm2 = ModelConfig(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                          num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192)
    assert smollm2.kv_bytes_per_token(dtype_size=2) == 2 * 30 * 3 * 64 * 2 == 23040
