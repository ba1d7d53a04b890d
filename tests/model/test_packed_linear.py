"""oneDNN-packed linear weights: the same outputs as nn.Linear to float tolerance, only inside
`installed()`, the same greedy tokens from an engine, and their memory counted by the KV budget."""

from __future__ import annotations

import copy

import pytest
import torch

from llm_runtime import EngineConfig, LLMEngine, SamplingParams
from llm_runtime.attention import kv_block_bytes
from llm_runtime.engine.kv_budget import activation_bytes, tensor_bytes
from llm_runtime.model.packed_linear import PackedLinears, packing_unsupported_reason

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch without oneDNN")


@pytest.fixture
def float_model(tiny_pairs):
    return copy.deepcopy(tiny_pairs["qwen3"][0]).float()


def test_packed_layers_compute_the_same_logits_and_only_while_installed(float_model) -> None:
    input_ids = torch.randint(0, float_model.config.vocab_size, (1, 37), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        plain = float_model.compute_logits(float_model(input_ids)[0])
        packed = PackedLinears(float_model)
        linears = [m for m in float_model.modules() if isinstance(m, torch.nn.Linear)]
        assert len(packed) == len(linears) and packed.nbytes >= sum(m.weight.numel() * 4 for m in linears)
        with packed.installed():
            assert all("forward" in vars(m) for m in linears)  # routed through the packed copy
            through_packed = float_model.compute_logits(float_model(input_ids)[0])
        assert not any("forward" in vars(m) for m in linears)  # and back to nn.Linear's own
        again = float_model.compute_logits(float_model(input_ids)[0])
    assert torch.equal(again, plain)
    assert (through_packed - plain).abs().max().item() < 1e-4  # another order of additions


def test_the_engine_with_packed_weights_gives_the_same_greedy_tokens(float_model) -> None:
    prompts = [list(range(3, 40)), [5] * 9, list(range(10, 70))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens, blocks = {}, {}
    block_bytes = kv_block_bytes(float_model.config, 16, torch.float32)
    options = dict(max_num_seqs=4, max_num_batched_tokens=32)
    # An emulated device with room for the weights, the activations and 100 blocks besides (fewer than 4 sequences could use).
    held = tensor_bytes(float_model) + activation_bytes(float_model, EngineConfig(**options))
    device_memory = int((held + 100 * block_bytes) / EngineConfig().gpu_memory_utilization)
    for prepack in (False, True):
        engine = LLMEngine(float_model, None, EngineConfig(**options, prepack_weights=prepack,
                                                           cpu_device_memory=device_memory))
        assert engine.stats().prepacked_weights is prepack
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        finished = {}
        while engine.has_unfinished_requests():
            finished.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        tokens[prepack], blocks[prepack] = finished, engine.block_manager.num_total_blocks
        packed_bytes = engine.packed_weight_bytes
        engine.shutdown()
        assert engine.packed_linears is None  # freed with the engine
    assert tokens[True] == tokens[False]
    # The packed copy is device memory: the pool is smaller by its size in blocks.
    assert blocks[False] == pytest.approx(100, abs=1) and packed_bytes > 0
    assert blocks[False] - blocks[True] == pytest.approx(packed_bytes / block_bytes, abs=1)


def test_packing_is_refused_where_it_does_not_apply(tiny_pairs) -> None:
    model64 = tiny_pairs["qwen3"][0]  # float64
    assert "float32" in packing_unsupported_reason(model64)
    with pytest.raises(ValueError, match="prepack_weights=True, but"):
        LLMEngine(model64, None, EngineConfig(prepack_weights=True, num_kv_blocks=8))
    with pytest.raises(ValueError, match="prepack_weights must be True or False"):
        EngineConfig(prepack_weights="auto")
