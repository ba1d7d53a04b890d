"""oneDNN-packed linear weights: the same outputs as nn.Linear to float tolerance, packed in place as one
copy (a tied head's is a second, counted), the same greedy tokens from an engine, and packing only where
the model is owned or it is asked for."""

from __future__ import annotations

import copy

import pytest
import torch

from llm_runtime import LLM, EngineConfig, LLMEngine, SamplingParams
from llm_runtime.worker.kv_budget import tensor_bytes
from llm_runtime.model.packed_linear import FusedPackedLinear, PackedLinear, is_packed, pack_linears_, packing_unsupported_reason

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch without oneDNN")


@pytest.fixture
def float_model(tiny_pairs):
    return copy.deepcopy(tiny_pairs["qwen3"][0]).float()


def _linears(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in model.named_modules() if isinstance(m, (torch.nn.Linear, PackedLinear))}


@pytest.mark.parametrize("family", ["qwen3", "qwen2"], ids=["untied", "tied-with-biases"])
def test_packing_in_place_keeps_the_logits_and_one_copy_of_the_weights(tiny_pairs, family) -> None:
    float_model = copy.deepcopy(tiny_pairs[family][0]).float()
    input_ids = torch.randint(0, float_model.config.vocab_size, (1, 37), generator=torch.Generator().manual_seed(0))
    plain_weights = {name: m.weight.detach().clone() for name, m in _linears(float_model).items()}
    plain_state = {name: t.clone() for name, t in float_model.state_dict().items()}
    bytes_before = tensor_bytes(float_model)
    with torch.inference_mode():
        plain = float_model.compute_logits(float_model(input_ids)[0])
    packed_names = pack_linears_(float_model)
    linears = _linears(float_model)
    assert set(packed_names) == set(linears) and all(isinstance(linears[name], PackedLinear) for name in linears)
    assert is_packed(float_model) and pack_linears_(float_model) == []  # packing twice changes nothing
    # The plain weights are gone: the same bytes as before (the blocked layout may pad a little), except
    # for a head tied to the embedding, whose packed weight is a second copy (the embedding keeps its own).
    tied_copy = linears["lm_head"].nbytes if float_model.config.tie_word_embeddings else 0
    assert bytes_before + tied_copy <= tensor_bytes(float_model) < 1.05 * bytes_before + tied_copy
    for name in packed_names:  # and come back exactly, unpacked on demand (a fused group: its parts side by side)
        module = linears[name]
        parent = name.rpartition(".")[0]
        parts = [f"{parent}.{part}" for part in module.part_names] if isinstance(module, FusedPackedLinear) else [name]
        assert torch.equal(module.weight, torch.cat([plain_weights[part] for part in parts]))
    fused = sorted(name.rpartition(".")[2] for name in packed_names if isinstance(linears[name], FusedPackedLinear))
    assert fused.count("qkv_proj") == fused.count("gate_up_proj") == float_model.config.num_layers
    assert {name.rpartition(".")[2] for name in linears} == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj",
                                                             "lm_head"}
    assert set(float_model.state_dict()) == set(plain_state)
    assert all(torch.equal(float_model.state_dict()[k], v) for k, v in plain_state.items())
    with torch.inference_mode():
        through_packed = float_model.compute_logits(float_model(input_ids)[0])
    assert (through_packed - plain).abs().max().item() < 1e-4  # another order of additions


def test_the_engine_packs_only_a_model_it_owns_or_is_asked_to(float_model) -> None:
    prompts = [list(range(3, 40)), [5] * 9, list(range(10, 70))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for prepack in (None, True):  # None: a model passed in is not the engine's, so it stays plain
        engine = LLMEngine(float_model, None, EngineConfig(max_num_seqs=4, max_num_batched_tokens=32,
                                                           prepack_weights=prepack, num_kv_blocks=40))
        assert engine.stats().prepacked_weights is bool(prepack) and is_packed(float_model) is bool(prepack)
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        finished = {}
        while engine.has_unfinished_requests():
            finished.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        tokens[prepack] = finished
        engine.shutdown()
    assert tokens[True] == tokens[None]
    assert is_packed(float_model)  # packing lasts beyond the engine, like model.half()


def test_an_engine_that_loaded_its_model_packs_it(float_model) -> None:
    """Unless its native step runs the dense layers, which reads them plain (worker/native_step.py)."""
    owned = copy.deepcopy(float_model)
    engine = LLMEngine(owned, None, EngineConfig(num_kv_blocks=8, native_step=False), owns_model=True)
    assert engine.stats().prepacked_weights and is_packed(owned)
    engine = LLMEngine(copy.deepcopy(float_model), None, EngineConfig(num_kv_blocks=8, prepack_weights=False),
                       owns_model=True)
    assert not engine.stats().prepacked_weights
    with LLM(num_kv_blocks=16, compile_model=False) as llm:  # the bundled model, loaded by LLM itself
        stats = llm.llm_engine.stats()
        assert stats.prepacked_weights is (packing_unsupported_reason(llm.model) is None and not stats.native_step)


def test_packing_is_refused_where_it_does_not_apply(tiny_pairs) -> None:
    model64 = tiny_pairs["qwen3"][0]  # float64
    assert "float32" in packing_unsupported_reason(model64)
    with pytest.raises(ValueError, match="prepack_weights=True, but"):
        LLMEngine(model64, None, EngineConfig(prepack_weights=True, num_kv_blocks=8))
    engine = LLMEngine(model64, None, EngineConfig(num_kv_blocks=8), owns_model=True)  # auto: left plain
    assert not engine.stats().prepacked_weights and not is_packed(model64)
    with pytest.raises(ValueError, match="prepack_weights must be True, False or None"):
        EngineConfig(prepack_weights="auto")


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="no bfloat16 instructions for oneDNN")
def test_bfloat16_weights_pack_and_keep_the_logits(tiny_pairs) -> None:
    model = copy.deepcopy(tiny_pairs["qwen2"][0]).to(torch.bfloat16)
    input_ids = torch.randint(0, model.config.vocab_size, (1, 23), generator=torch.Generator().manual_seed(1))
    assert packing_unsupported_reason(model) is None
    with torch.inference_mode():
        plain = model.compute_logits(model(input_ids)[0]).float()
        pack_linears_(model)
        packed = model.compute_logits(model(input_ids)[0]).float()
    assert is_packed(model)
    torch.testing.assert_close(packed, plain, rtol=0.05, atol=0.05)  # bfloat16: another order of additions


def test_the_operator_for_compiled_graphs_is_the_packed_product() -> None:
    """`packed_linear`, oneDNN's product over a packed weight as one operator of this package (inductor lowers
    oneDNN's own only over weights it froze itself), gives the layer's output. (PyTorch's operator checks
    read the weight's storage, which an opaque oneDNN tensor does not have: the compiled engine over packed
    layers is tested in tests/worker/test_compiled_forward.py.)"""
    from llm_runtime.model.packed_linear import packed_linear

    packed = PackedLinear(torch.nn.Linear(64, 48))
    x = torch.randn(5, 64)
    with torch.no_grad():
        assert torch.equal(packed_linear(x, packed.packed_weight, packed.bias), packed(x))
