"""Sharded layers (distributed/sharding.py) against the whole model, in float64 on gloo ranks: every decoder
layer's output and the logits equal the unsharded model's to rounding, at 2 ranks for every family (one has a
single KV head, replicated) and at 4 (2 KV heads over 4 ranks). Shapes that do not split are refused."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from llm_runtime.config import ModelConfig
from llm_runtime.distributed.group import TensorParallelGroup
from llm_runtime.distributed.launch import run_on_ranks
from llm_runtime.distributed.sharding import (local_config, plan_shards, shard_model_,
                                              tensor_parallel_unsupported_reason)
from llm_runtime.model import load_checkpoint

IDS = torch.tensor([[5, 17, 3, 42, 8, 11, 60, 96, 0, 50]])  # 0 and 96: the first and last rows of the vocabulary


def _layer_outputs(model, ids: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Each decoder layer's output (the residual stream after it) and the logits of every position."""
    outputs: list[torch.Tensor] = []
    hooks = [layer.register_forward_hook(lambda _m, _i, out: outputs.append(out.detach().clone()))
             for layer in model.model.layers]
    with torch.inference_mode():
        logits = model.compute_logits(model(ids))
    for hook in hooks:
        hook.remove()
    return outputs, logits


def _sharded_outputs(tp: TensorParallelGroup, folders: dict[str, str]) -> dict[str, tuple]:
    """On each rank: every family's checkpoint loaded whole, sharded, run; rank 0's outputs returned."""
    results = {}
    for family, folder in folders.items():
        model = shard_model_(load_checkpoint(Path(folder), device=torch.device("cpu"), dtype=torch.float64), tp)
        # The loader's own shard: each tensor's slice read from the file, not the whole tensor then a slice.
        direct = load_checkpoint(Path(folder), device=torch.device("cpu"), dtype=torch.float64, tensor_parallel=tp)
        same = model.state_dict().keys() == direct.state_dict().keys() and all(
            torch.equal(a, b) for a, b in zip(model.state_dict().values(), direct.state_dict().values()))
        tied = direct.lm_head.weight is direct.model.embed_tokens.weight
        tp.counts.reset()
        layers, logits = _layer_outputs(direct, IDS)
        counts = (tp.counts.all_reduces, tp.counts.all_reduce_bytes, tp.counts.gathers, tp.counts.gather_bytes)
        results[family] = (layers, logits, model.config.num_heads, model.config.num_kv_heads,
                           model.lm_head.weight.shape[0], same, tied, counts)
    return results if tp.is_first else {}


@pytest.mark.parametrize("size, families", [
    (2, ["llama2", "llama3", "llama_linear_rope", "smollm2", "qwen2", "qwen3"]),
    (4, ["llama3", "qwen3"]),
])
def test_every_layer_and_the_logits_equal_the_whole_models(tiny_checkpoints, tiny_pairs, size: int,
                                                             families: list[str]) -> None:
    folders = {family: str(tiny_checkpoints[family]) for family in families}
    sharded = run_on_ranks(_sharded_outputs, size, folders)[0]
    for family in families:
        whole = tiny_pairs[family][0]
        expected_layers, expected_logits = _layer_outputs(whole, IDS)
        layers, logits, heads, kv_heads, vocab_rows, same, tied, counts = sharded[family]
        assert same and tied == whole.config.tie_word_embeddings  # the loader's shard is the sliced model's
        # What a rank hands the collectives for T tokens: 2 all-reduces per layer and one for the embedding, each
        # T x hidden float64s; one gather of its T x (vocab / size) logits.
        tokens, config = IDS.numel(), whole.config
        assert counts == (2 * config.num_layers + 1, (2 * config.num_layers + 1) * tokens * config.hidden_size * 8,
                          1, tokens * vocab_rows * 8)
        assert heads == whole.config.num_heads // size
        assert kv_heads == max(1, whole.config.num_kv_heads // size)  # smollm2's one KV head: replicated
        assert vocab_rows == -(-whole.config.vocab_size // size)  # 97 rows: the last shard padded
        assert logits.shape == expected_logits.shape
        for got, want in zip(layers, expected_layers, strict=True):
            assert (got - want).abs().max().item() < 1e-10, family
        assert (logits - expected_logits).abs().max().item() < 1e-10, family


def _config(**changes) -> ModelConfig:
    base = dict(model_type="llama", vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4,
                num_kv_heads=2, head_dim=16, max_position_embeddings=64)
    return ModelConfig(**{**base, **changes})


@pytest.mark.parametrize("changes, size, message", [
    ({}, 3, "4 attention heads do not divide over 3"),
    ({"num_heads": 6, "num_kv_heads": 3}, 2, "3 KV heads neither divide over 2 ranks"),
    ({"intermediate_size": 90}, 4, "MLP size 90 does not divide over 4"),
    ({}, 0, "tensor_parallel_size must be an integer >= 1"),
])
def test_shapes_that_do_not_split_are_refused(changes: dict, size: int, message: str) -> None:
    config = _config(**changes)
    assert message in tensor_parallel_unsupported_reason(config, size)
    with pytest.raises(ValueError, match=message):
        plan_shards(config, 0, max(size, 1) if size else size)


def test_the_plan_keeps_whole_heads_and_the_bias_once() -> None:
    config = _config(num_heads=8, num_kv_heads=2, mlp_bias=True)
    shards = [plan_shards(config, rank, 4) for rank in range(4)]
    k = [s["model.layers.0.self_attn.k_proj.weight"] for s in shards]
    assert [(x.start, x.stop) for x in k] == [(0, 16), (0, 16), (16, 32), (16, 32)]  # each KV head on two ranks
    q = [s["model.layers.0.self_attn.q_proj.weight"] for s in shards]
    assert [(x.start, x.stop) for x in q] == [(0, 32), (32, 64), (64, 96), (96, 128)]
    assert [s["model.layers.0.mlp.down_proj.bias"].zero for s in shards] == [False, True, True, True]
    assert local_config(config, 4).num_kv_heads == 1 and local_config(config, 2).num_heads == 4
    vocab = [s["model.embed_tokens.weight"] for s in shards]
    assert [(x.start, x.stop, x.padded) for x in vocab] == [(0, 25, 25), (25, 50, 25), (50, 75, 25), (75, 97, 25)]


def test_a_single_rank_is_the_model_itself(tiny_pairs) -> None:
    model = copy.deepcopy(tiny_pairs["llama3"][0])
    assert shard_model_(model, TensorParallelGroup(0, 1)) is model and model.tp is None
