"""Batch invariance with Triton kernels (model/batch_invariant.py, lesson 16): the mode's CUDA setup.

On a GPU `batch_invariant=True` multiplies every linear by the fixed-tile Triton matrix multiply, normalises by
the per-row Triton RMSNorm and attends with the `triton` backend's unified kernel, one tile size, never split-KV.
Without a GPU the same setup runs under Triton's interpreter (an engine with `attention_backend="triton"`), on a
tiny model: it computes the model (to rounding), with every part replaced; the interpreter's `tl.dot` is NumPy's
matrix multiply, whose rounding depends on a row's place in a tile, so the bitwise comparisons of the mode are
the GPU-marked ones at the end, on the bundled model as tests/engine/test_batch_invariance.py runs them on the CPU.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("TRITON_INTERPRET=1 must be set before triton is imported (tests/conftest.py does it)")
pytest.importorskip("triton")

from llm_runtime import LLM, SamplingParams, encode_chat, load_model
from llm_runtime.attention.cpu_backend import CpuKernelBackend
from llm_runtime.attention.selector import select_backend
from llm_runtime.attention.triton_backend import TritonBackend
from llm_runtime.model.batch_invariant import batch_invariant_unsupported_reason, make_triton_invariant_
from llm_runtime.model.invariant_matmul import InvariantLinear
from llm_runtime.model.pointwise import pointwise_ops_of
from llm_runtime.model.quantized_linear import quantize_linears_


@pytest.mark.parametrize("family", ["llama3", "smollm2", "qwen3"])  # qwen3: per-head q and k norms; smollm2: tied
def test_the_triton_setup_computes_the_same_model(tiny_pairs, family: str) -> None:
    reference = copy.deepcopy(tiny_pairs[family][0]).float()
    model = copy.deepcopy(reference)
    linears = sum(type(m) is nn.Linear for m in model.modules())
    assert make_triton_invariant_(model) == linears
    assert not any(type(m) is nn.Linear for m in model.modules()) and pointwise_ops_of(model).name == "invariant"
    assert model.state_dict().keys() == reference.state_dict().keys()
    if reference.lm_head.weight is reference.model.embed_tokens.weight:
        assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    ids = torch.tensor([[5, 17, 3, 42, 8, 11, 60]])
    with torch.inference_mode():
        expected, got = (m.compute_logits(m(ids)) for m in (reference, model))
    assert (got - expected).abs().max().item() < 1e-4


def test_the_selector_gives_each_device_its_invariant_attention() -> None:
    cpu = select_backend("auto", "cpu", torch.bfloat16, batch_invariant=True)
    assert isinstance(cpu, CpuKernelBackend) and cpu.kernel_max_rows >= 2**62  # every row through the C kernel
    cuda = select_backend("auto", "cuda", torch.bfloat16, batch_invariant=True)  # is_available needs no GPU here
    assert isinstance(cuda, TritonBackend) and (cuda.split_kv, cuda.block_m) == ("never", 16)
    assert select_backend("auto", "cuda", torch.bfloat16).block_m is None  # the default mode chooses per step
    with pytest.raises(ValueError, match="'blockwise' has no batch-invariant mode"):
        select_backend("blockwise", "cpu", torch.bfloat16, batch_invariant=True)
    with pytest.raises(ValueError, match="block_m must be a power of two"):
        TritonBackend(block_m=24)


def test_quantized_and_prepacked_models_are_refused(tiny_pairs) -> None:
    model = copy.deepcopy(tiny_pairs["llama3"][0]).float()
    quantize_linears_(model, "int8")
    assert "quantized layers (Int8Linear)" in batch_invariant_unsupported_reason(model)
    with pytest.raises(ValueError, match="quantized layers"):
        LLM.from_model(model, None, batch_invariant=True, num_kv_blocks=16)


def test_an_engine_runs_the_triton_setup(tiny_pairs) -> None:
    """Under the interpreter on the CPU: the engine builds the mode around the Triton backend, its linears and
    norms are replaced, prefill chunks and decodes run, and the logprobs are the default engine's to rounding."""
    prompts = [[5, 17, 3, 42, 8, 11, 60, 7, 9], [1, 2, 3, 4], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41]]
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=0, prompt_logprobs=0)
    requests = [{"prompt_token_ids": p} for p in prompts]
    reference = copy.deepcopy(tiny_pairs["llama3"][0]).float()
    with LLM.from_model(reference, None, num_kv_blocks=32, compile_model=False) as llm:
        expected = llm.generate(requests, params, use_tqdm=False)
    model = copy.deepcopy(reference)
    with LLM.from_model(model, None, batch_invariant=True, attention_backend="triton", num_kv_blocks=32,
                        max_num_batched_tokens=8, max_num_seqs=4) as llm:  # prompts chunked beside decodes
        backend = llm.llm_engine.attention_backend
        assert isinstance(backend, TritonBackend) and (backend.split_kv, backend.block_m) == ("never", 16)
        assert isinstance(model.lm_head, InvariantLinear) and pointwise_ops_of(model).name == "invariant"
        got = llm.generate(requests, params, use_tqdm=False)
    for want, have in zip(expected, got):
        assert have.outputs[0].token_ids == want.outputs[0].token_ids
        pairs = [(e[t], h[t]) for e, h, t in zip(want.prompt_logprobs[1:], have.prompt_logprobs[1:],
                                                  want.prompt_token_ids[1:])]
        pairs += [(e[t], h[t]) for e, h, t in zip(want.outputs[0].logprobs, have.outputs[0].logprobs,
                                                  want.outputs[0].token_ids)]
        assert max(abs(a - b) for a, b in pairs) < 1e-4


# ---------------------------------------------------------------------------------------------
# On a GPU: the bits


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_a_request_alone_and_in_a_busy_batch_gives_the_same_bits() -> None:
    dtype = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    model, tokenizer = load_model(None, device="cuda", dtype=dtype)
    questions = ["What is the capital of France?", "Write a haiku about autumn.", "Name three colors.",
                 "Explain gravity simply.", "List the days of the week.", "What is 12 times 7?"] * 4  # 24
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": f"{q} ({i})"}]) for i, q in enumerate(questions)]
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=0)

    def bits(outputs):
        return [(tuple(o.outputs[0].token_ids),
                 tuple(e[t] for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids))) for o in outputs]

    with LLM.from_model(model, tokenizer, batch_invariant=True, kv_cache_memory=1 << 30) as llm:
        backend = llm.llm_engine.attention_backend
        assert isinstance(backend, TritonBackend) and backend.split_kv == "never"
        alone = [bits(llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False))[0] for p in prompts[:6]]
    with LLM.from_model(model, tokenizer, batch_invariant=True, kv_cache_memory=1 << 30, max_num_batched_tokens=64,
                        enable_prefix_caching=True) as llm:
        busy = bits(llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))
        again = bits(llm.generate([{"prompt_token_ids": p} for p in reversed(prompts)], params, use_tqdm=False))
        # A scoring pass: prompt + completion as one prompt, each completion token's logprob from a prefill row.
        scored = llm.generate([{"prompt_token_ids": p + list(tokens)} for p, (tokens, _) in zip(prompts, alone)],
                              SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    assert busy[:6] == alone and again[::-1][:6] == alone
    for prompt, (tokens, logprobs), out in zip(prompts, alone, scored):
        entries = out.prompt_logprobs[len(prompt):]
        assert tuple(e[t] for e, t in zip(entries, tokens)) == logprobs
