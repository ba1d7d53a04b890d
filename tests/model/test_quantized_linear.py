"""Quantized linear layers (lesson 13): round trips within their bounds, layers equal to their de-quantized
weights, a quantized model's greedy tokens equal to the de-quantized model's, and the GGUF's Q4_1 blocks
loaded exactly."""

from __future__ import annotations

import copy
import struct

import numpy as np
import pytest
import torch
from torch import nn

from llm_runtime import LLM, SamplingParams, generate, load_model
from llm_runtime.model.gguf import (Q8_0_BLOCK_BYTES, dequantize_q4_1, gguf_linear_blocks, q4_1_blocks, q8_0_blocks,
                                   read_gguf_tensors)
from llm_runtime.model.bundled import find_bundled_gguf
from llm_runtime.model.quantized_embedding import SMALL_M, Q8Embedding, Q8Head, Q8Table
from llm_runtime.worker.kv_budget import tensor_bytes
from llm_runtime.model.quantized_linear import (Int4Linear, Int8GroupLinear, Int8Linear, dequantize_int4,
                                                dequantize_int8, dequantize_int8_groups, is_quantized, quantize_int4,
                                                quantize_int8, quantize_int8_groups, quantize_linears_)


def test_int8_round_trip_is_within_half_a_step_per_channel() -> None:
    w = torch.randn(48, 96, dtype=torch.float64) * torch.logspace(-2, 1, 48, dtype=torch.float64)[:, None]
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127
    error = (dequantize_int8(q, scale) - w).abs()
    assert bool((error <= scale[:, None] / 2 + 1e-6 * w.abs()).all())


@pytest.mark.parametrize("group_size", [32, 64])
def test_int4_round_trip_is_within_half_a_step_per_group(group_size: int) -> None:
    w = torch.randn(40, 128) * 3
    q, scale, zero = quantize_int4(w, group_size)
    assert int(q.min()) == 0 and int(q.max()) == 15
    error = (dequantize_int4(q, scale, zero) - w).abs().reshape(40, -1, group_size)
    assert bool((error <= scale[..., None] / 2 + 1e-5).all())
    # The group's minimum and maximum are on the grid (asymmetric quantization).
    groups = w.reshape(40, -1, group_size)
    deq = dequantize_int4(q, scale, zero).reshape(40, -1, group_size)
    torch.testing.assert_close(deq.amin(-1), groups.amin(-1), atol=1e-5, rtol=0)
    torch.testing.assert_close(deq.amax(-1), groups.amax(-1), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="multiple of the group size"):
        quantize_int4(torch.randn(4, 48), 32)


def test_int8_groups_round_trip_within_half_a_step_and_hold_a_4_bit_grid_exactly() -> None:
    torch.manual_seed(0)  # unseeded, 15 draws in 200 put a 4-bit level a few float32 steps past atol
    w = torch.randn(40, 128) * torch.logspace(-2, 1, 40)[:, None]
    q, scale, zero = quantize_int8_groups(w)
    assert q.dtype == torch.int8 and int(q.min()) >= -128 and int(q.max()) == 127
    error = (dequantize_int8_groups(q, scale, zero) - w).abs().reshape(40, -1, 32)
    assert bool((error <= scale[..., None] / 2 + 1e-6 * w.abs().reshape(40, -1, 32)).all())
    # Each group's grid is the better of its range in 255 steps and 127 steps either side of zero.
    ranged = (w.reshape(40, -1, 32).amax(-1) - w.reshape(40, -1, 32).amin(-1)) / 255
    assert bool(((scale - ranged).abs() < 1e-7 + 1e-5 * ranged).any() and (zero == 0).any())
    # A Q4_1-like weight (16 levels d * k + m per group) lands on the 256-step grid: step d / 17.
    d, m = torch.rand(40, 4, 1) + 0.1, torch.randn(40, 4, 1)
    levels = torch.randint(0, 16, (40, 4, 32))
    levels[..., 0], levels[..., 1] = 0, 15  # every group spans its 16 levels
    four_bit = (levels * d + m).reshape(40, 128)
    torch.testing.assert_close(dequantize_int8_groups(*quantize_int8_groups(four_bit)), four_bit, atol=2e-6, rtol=0)
    # A Q8_0-like weight (d * k, k in -127..127, the largest |k| 127 per group) lands on the symmetric grid.
    steps = torch.randint(-127, 128, (40, 4, 32))
    steps[..., 0] = 127
    eight_bit = (steps * d).reshape(40, 128)
    torch.testing.assert_close(dequantize_int8_groups(*quantize_int8_groups(eight_bit)), eight_bit, atol=2e-6,
                               rtol=0)
    with pytest.raises(ValueError, match="multiple of the group size"):
        quantize_int8_groups(torch.randn(4, 48))


@pytest.mark.parametrize("kind", ["int8", "int8 in groups", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 40])  # int8 in groups: the one-pass kernel, and tiles turned back
def test_a_quantized_layer_multiplies_by_its_dequantized_weight(kind: str, dtype: torch.dtype, rows: int) -> None:
    torch.manual_seed(0)
    w, bias = torch.randn(96, 128), torch.randn(96)
    x = torch.randn(rows, 5, 128)  # any leading shape
    if kind == "int8":
        layer = Int8Linear.from_weight(w, bias, dtype=dtype)
        reference = dequantize_int8(*quantize_int8(w))
    elif kind == "int8 in groups":
        layer = Int8GroupLinear.from_weight(w, bias, dtype=dtype)
        reference = dequantize_int8_groups(*quantize_int8_groups(w))
        torch.testing.assert_close(layer.dequantized(), reference.to(dtype).float(), atol=0, rtol=0) \
            if dtype == torch.float32 else None
    else:
        layer = Int4Linear.from_weight(w, bias, dtype=dtype, group_size=32)
        reference = dequantize_int4(*quantize_int4(w, 32))
    out = layer(x.to(dtype))
    assert out.shape == (rows, 5, 96) and out.dtype == dtype
    expected = x @ reference.T + bias
    tolerance = 1e-4 if dtype == torch.float32 else 0.1 * float(expected.abs().max()) / 8
    assert (out.float() - expected).abs().max().item() < tolerance


def _dequantized_copy(model: nn.Module, kind: str) -> nn.Module:
    """The float model whose linear weights are what `quantize_linears_` makes of them."""
    copy_ = copy.deepcopy(model)
    rounding = {"int8": lambda w: dequantize_int8(*quantize_int8(w)),
                "int8 in groups": lambda w: dequantize_int8_groups(*quantize_int8_groups(w)),
                "int4": lambda w: dequantize_int4(*quantize_int4(w, 32))}[kind]
    with torch.no_grad():
        for module in copy_.modules():
            if isinstance(module, nn.Linear):
                w = module.weight.float()
                deq = rounding(w)
                module.weight = nn.Parameter(deq.to(module.weight.dtype))  # unties a tied head, as quantizing does
    return copy_


@pytest.mark.parametrize("kind", ["int8", "int8 in groups", "int4"])
def test_a_quantized_model_gives_its_dequantized_models_greedy_tokens(tiny_pairs, kind: str) -> None:
    model = copy.deepcopy(tiny_pairs["qwen2"][0]).float()  # q/k/v biases, a tied head
    reference = _dequantized_copy(model, kind)
    group_size = 32 if kind == "int8 in groups" else None
    names = quantize_linears_(model, kind.split()[0], group_size=group_size, dtype=torch.float32)
    assert is_quantized(model) == kind.split()[0]
    assert "model.layers.0.self_attn.qkv_proj" in names and "model.layers.0.mlp.gate_up_proj" in names
    assert "lm_head" in names and not any(isinstance(m, nn.Linear) for m in model.modules())
    ids = torch.tensor([[5, 9, 13, 40, 2, 77, 31]])
    with torch.inference_mode():
        torch.testing.assert_close(model.compute_logits(model(ids)), reference.compute_logits(reference(ids)),
                                   atol=1e-4, rtol=1e-4)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = [[5, 9, 13], [40, 2, 77, 31, 8], [11] * 4]
    with LLM.from_model(model, None, num_kv_blocks=32) as llm:  # the engine: batching, paging
        outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outputs == [generate(reference, p, params) for p in prompts]


def test_bad_quantization_requests_are_refused(tiny_pairs) -> None:
    with pytest.raises(ValueError, match="quantization must be one of"):
        load_model(None, quantization="fp3")
    with pytest.raises(ValueError, match="bundled model"):
        load_model("some/model", quantization="gguf")
    with pytest.raises(ValueError, match="compute in"):
        load_model(None, quantization="int8", dtype="float16")
    with pytest.raises(ValueError, match="group_size"):
        quantize_linears_(copy.deepcopy(tiny_pairs["llama2"][0]), "int4", group_size=48)
    with pytest.raises(ValueError, match="int8 group_size"):
        quantize_linears_(copy.deepcopy(tiny_pairs["llama2"][0]), "int8", group_size=64)


# ------------------------------------------------------------------------------------ the bundled GGUF
def test_q4_1_and_q8_0_blocks_read_byte_by_byte() -> None:
    d, m = np.float16(0.5), np.float16(-1.25)
    values = np.arange(32) % 16  # weight j is values[j]
    nibbles = (values[:16] | (values[16:] << 4)).astype(np.uint8)  # byte j: weight j low, weight j + 16 high
    block = np.concatenate([np.array([d]).view(np.uint8), np.array([m]).view(np.uint8), nibbles])[None]
    q, scale, low = q4_1_blocks(block)
    assert q[0].tolist() == values.tolist() and scale.item() == 0.5 and low.item() == -1.25
    assert dequantize_q4_1(q, scale, low)[0].tolist() == (0.5 * values - 1.25).tolist()
    ints = np.arange(-16, 16, dtype=np.int8)
    q8, d8 = q8_0_blocks(np.concatenate([np.array([d]).view(np.uint8), ints.view(np.uint8)])[None])
    assert q8[0].tolist() == ints.tolist() and d8.item() == 0.5


def test_the_gguf_blocks_are_the_converted_checkpoints_weights_exactly(bundled) -> None:
    """Every Q4_1 weight of the file, de-quantized in float32, is the converted checkpoint's weight (q and k
    with llama.cpp's rotary row order undone), and the Q8_0 embedding too."""
    model, _ = bundled
    state = model.state_dict()
    blocks = gguf_linear_blocks(find_bundled_gguf(), model.config)
    assert len(blocks) == 7 * model.config.num_layers
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.29.mlp.down_proj"):
        assert torch.equal(dequantize_q4_1(*blocks[name]), state[f"{name}.weight"]), name
    embedding = read_gguf_tensors(find_bundled_gguf(), {"token_embd.weight"})["token_embd.weight"]
    q, d = q8_0_blocks(embedding.data)
    deq = (q.reshape(q.shape[0], -1, 32).float() * d[..., None]).reshape(q.shape[0], -1)
    assert torch.equal(deq, state["model.embed_tokens.weight"])


def test_the_files_tensors_are_read_as_the_gguf_package_reads_them(tmp_path) -> None:
    """read_gguf_tensors steps over the metadata by lengths alone; every tensor of the bundled file (name, type,
    shape, bytes) is what the `gguf` package's reader, which decodes all of it, finds. A file that is not GGUF,
    or is cut short, is refused."""
    from gguf import GGUFReader

    path = find_bundled_gguf()
    ours = read_gguf_tensors(path)
    theirs = GGUFReader(str(path)).tensors
    assert len(ours) == len(theirs) == 272 and {t.tensor_type.name for t in theirs} == {"F32", "Q4_1", "Q8_0"}
    for tensor in theirs:
        mine = ours[tensor.name]
        assert mine.type_name == tensor.tensor_type.name and mine.shape == tuple(reversed(tensor.shape.tolist()))
        assert mine.data.dtype == tensor.data.dtype and np.array_equal(mine.data, tensor.data), tensor.name
    assert list(read_gguf_tensors(path, {"output_norm.weight"})) == ["output_norm.weight"]
    (tmp_path / "not.gguf").write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf_tensors(tmp_path / "not.gguf")
    for size, match in ((5_000, "cut short"), (1_000_000, "cut short"), (50_000_000, "ends at byte")):
        (tmp_path / "cut.gguf").write_bytes(path.read_bytes()[:size])  # in the tokenizer's strings; in the tensors
        with pytest.raises(ValueError, match=match):
            read_gguf_tensors(tmp_path / "cut.gguf")


def _small_gguf(path, alignment: int | None = None, nested: bool = False):
    """A GGUF file written by the `gguf` package: an F16 matrix, an F32 vector, a Q8_0 matrix (raw blocks), some
    metadata (a string array, nested arrays when asked), and `general.alignment` when given."""
    from gguf import GGMLQuantizationType, GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_array("test.words", ["a", "bb", "ccc"])
    if nested:
        writer.add_array("test.nested", [[1, 2], [3]])
    half = np.arange(12, dtype=np.float16).reshape(3, 4)
    vector = np.linspace(-1, 1, 5, dtype=np.float32)
    blocks = np.random.default_rng(0).integers(0, 256, size=(2, 2 * Q8_0_BLOCK_BYTES), dtype=np.uint8)
    writer.add_tensor("half", half)
    writer.add_tensor("vector", vector)
    writer.add_tensor("q8", blocks, raw_dtype=GGMLQuantizationType.Q8_0)  # (2, 68) bytes: 2 rows of 64
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return half, vector, blocks


@pytest.mark.parametrize("alignment", [None, 64, 256])
def test_a_written_files_tensors_are_found_at_its_alignment(tmp_path, alignment) -> None:
    """Float tensors come back as their values, block tensors as their bytes, wherever the file's alignment puts
    them (the bundled file has neither an F16 tensor nor an alignment of its own)."""
    path = tmp_path / "small.gguf"
    half, vector, blocks = _small_gguf(path, alignment, nested=alignment == 256)
    tensors = read_gguf_tensors(path)
    assert tensors["half"].type_name == "F16" and np.array_equal(tensors["half"].data, half)
    assert tensors["vector"].shape == (5,) and np.array_equal(tensors["vector"].data, vector)
    assert tensors["q8"].type_name == "Q8_0" and tensors["q8"].shape == (2, 64)
    assert np.array_equal(tensors["q8"].data, blocks)


def test_a_malformed_gguf_is_refused_with_a_reason(tmp_path) -> None:
    path = tmp_path / "small.gguf"
    _small_gguf(path, 64)
    good = path.read_bytes()
    header = struct.calcsize("<4sIQQ")

    def refused(data: bytes, match: str) -> None:
        (tmp_path / "bad.gguf").write_bytes(data)
        with pytest.raises(ValueError, match=match):
            read_gguf_tensors(tmp_path / "bad.gguf")

    refused(b"GGML" + good[4:], "not a GGUF file")
    refused(good[:4] + struct.pack("<I", 1) + good[8:], "version 1")
    refused(good[:header] + struct.pack("<Q", 2**62) + good[header + 8 :], "cut short")  # the first key's length
    refused(good[:-100], "ends at byte")  # into the last tensor's bytes (past the padding after it)
    at = good.index(b"general.alignment") + len(b"general.alignment") + 4  # its value, after its type
    refused(good[:at] + struct.pack("<I", 48) + good[at + 4 :], "power of two")
    at = good.index(b"test.words") + len(b"test.words") + 4  # the array's item type, then its count
    refused(good[:at + 4] + struct.pack("<Q", 2**60) + good[at + 12 :], "cut short")


def test_the_native_4_bit_model_has_the_dequantized_models_logits(bundled) -> None:
    """In float32 the int4 layers holding the file's blocks give the de-quantized float model's logits."""
    reference, _ = bundled
    native, _ = load_model(None, quantization="gguf", dtype="float32")
    assert is_quantized(native) == "int4"
    assert isinstance(native.model.embed_tokens, Q8Embedding) and native.lm_head.table is native.model.embed_tokens.table
    ids = torch.tensor([list(range(100, 140))])
    with torch.inference_mode():
        hidden, expected = native(ids), reference(ids)
        torch.testing.assert_close(hidden, expected, atol=2e-4, rtol=0)
        torch.testing.assert_close(native.compute_logits(hidden), reference.compute_logits(expected),  # 40 rows
                                   atol=2e-3, rtol=0)
        torch.testing.assert_close(native.compute_logits(hidden[0, -1:]), reference.compute_logits(expected[0, -1:]),
                                   atol=2e-3, rtol=0)  # one row: the per-block int8 products


@pytest.mark.slow
def test_int8_in_groups_in_float32_agrees_with_the_float32_model(bundled) -> None:
    """Issue 14's int8 target: each of the file's 4-bit groups lands on int8's 256-step grid and each of its
    head's Q8_0 blocks on the symmetric one, so nothing is rounded again: the logits of the float32 model."""
    from llm_runtime.bench.quality import compare, eval_text

    reference, tokenizer = bundled
    model, _ = load_model(None, quantization="int8", group_size=32, dtype="float32")
    report = compare(model, reference, tokenizer.encode(eval_text())[:513])
    assert report.top1_agreement >= 0.995 and report.kl_divergence < 1e-5


def test_the_native_model_weighs_under_110_megabytes() -> None:
    """In bfloat16: the int4 decoder layers (about 66 MB) and the Q8_0 table shared by embedding and head (30 MB)."""
    native, _ = load_model(None, quantization="gguf")
    assert tensor_bytes(native) < 110e6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_q8_0_table_looks_up_and_multiplies_as_its_float_weights(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (300, 64), generator=gen, dtype=torch.int8)
    d = torch.rand(300, 2, generator=gen) / 100
    weight = (q.view(300, 2, 32).float() * d[..., None]).view(300, 64)
    table = Q8Table(q, d, dtype)
    assert table.q.shape == (2, 300, 32) and table.d.dtype == dtype
    ids = torch.tensor([[0, 299, 7], [5, 5, 1]])
    tolerance = 0 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(Q8Embedding(table)(ids).float(), weight[ids], atol=tolerance * 1.3, rtol=0)
    head = Q8Head(table)
    for rows in (1, SMALL_M, SMALL_M + 1, 40):  # both paths: per-block int8 products, then tiles
        x = torch.randn(rows, 64, generator=gen)
        expected = x.to(dtype).float() @ weight.t()
        assert (head(x.to(dtype)).float() - expected).abs().max() < (1e-4 if dtype == torch.float32 else 0.1)  # ~8: 1/2 ulp 0.03
    with pytest.raises(ValueError, match="Q8_0"):
        Q8Table(q, d[:, :1], dtype)


def test_llm_and_the_command_line_take_a_quantization(capsys) -> None:
    from llm_runtime.__main__ import main

    # In float32: in bfloat16 the first token is a near-tie ("The" 25.625 against "L" 25.375, a step of 0.125).
    # compile_model=False: compiling is test_compiled_forward's (a graph here would cost most of this test's time)
    with LLM(quantization="gguf", dtype="float32", max_num_seqs=2, compile_model=False) as llm:
        assert is_quantized(llm.model) == "int4" and llm.model.dtype == torch.float32
        answer = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                          SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
        assert "Paris" in answer[0].outputs[0].text
    assert main(["generate", "--quantization", "int8", "--max-tokens", "4", "Hi"]) == 0
    assert "bfloat16" in capsys.readouterr().err  # a quantized model computes in bfloat16 by default
