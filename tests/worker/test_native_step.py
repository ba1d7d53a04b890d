"""The step as one native call (worker/native_step.py): the eager path's logits within the dtype's rounding, the
same greedy tokens; each row computed alone, so exactly the same tokens alone, in any batch, with drafts verified
and with prefix hits; what it covers and why not elsewhere.

The bundled model in its GGUF form (int4 layers, a Q8_0 head), a random int4 model with an int4 head, and the
bundled model's dense weights in float32 and bfloat16 (the dense products, tests at the end).
"""

from __future__ import annotations

import pytest
import torch

from llm_runtime import LLM, SamplingParams, encode_chat
from llm_runtime.config import ModelConfig
from llm_runtime.worker.kv_budget import CPU_DEVICE, tensor_bytes
from llm_runtime.worker import native_step
from llm_runtime.worker.native_step import MAX_TOKENS, library_unavailable_reason, native_step_unavailable_reason
from llm_runtime.model import CausalLM, load_model
from llm_runtime.model.quantized_linear import quantize_linears_

needs_int4 = pytest.mark.skipif(library_unavailable_reason() is not None,
                                reason=f"the native int4 step does not run here: {library_unavailable_reason()}")
needs_dense = pytest.mark.skipif(library_unavailable_reason(dense=True) is not None,
                                 reason=f"the native dense step does not run here: {library_unavailable_reason(True)}")

POOL = 64 << 20
TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg, a goldsmith "
        "from Mainz, combined movable metal type, oil-based ink and a wooden press adapted from wine making.")
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def gguf():
    return load_model(quantization="gguf")


def _random_int4(seed: int = 0) -> CausalLM:
    """2 layers of random weights, int4 linears and head in bfloat16 (hidden 128, 4 heads of 32, 2 KV heads)."""
    torch.manual_seed(seed)
    config = ModelConfig("llama", vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=32, max_position_embeddings=256)
    model = CausalLM(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.5 if parameter.dim() == 1 else 0.08)
            if parameter.dim() == 1:
                parameter.add_(1)
    model = model.to(torch.bfloat16).eval()
    quantize_linears_(model, "int4", dtype=torch.bfloat16)
    return model


def _generate(model, prompts, params=GREEDY, **options) -> tuple[list[list[int]], object]:
    llm = LLM.from_model(model, None, kv_cache_memory=POOL, **options)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        stats = llm.llm_engine.stats()
        assert stats.num_native_steps <= llm.llm_engine.profile.num_steps
        return [o.outputs[0].token_ids for o in outputs], (stats, llm.llm_engine.profile.num_steps)
    finally:
        llm.shutdown()


def _prompts(vocab: int, lengths: tuple[int, ...], seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


def _teacher_forced_logits(model, tokens: list[int], start: int, **options) -> torch.Tensor:
    """The logits after tokens[:n] for n = start .. len(tokens) - 1 (rows), each a request of its own whose
    earlier blocks the prefix cache holds: its last few tokens are one short step."""
    llm = LLM.from_model(model, None, kv_cache_memory=POOL, **options)
    engine, rows = llm.llm_engine, []
    sample = engine.model_runner._sample

    def spy(batch, sampling, logits, output):
        rows.append(logits[-1].float().clone())
        return sample(batch, sampling, logits, output)

    engine.model_runner._sample = spy
    try:
        for n in range(start, len(tokens)):
            llm.generate([{"prompt_token_ids": tokens[:n]}], SamplingParams(temperature=0, max_tokens=1),
                         use_tqdm=False)
        return torch.stack(rows[-(len(tokens) - start):]), engine.stats()
    finally:
        llm.shutdown()


@needs_int4
@pytest.mark.parametrize("which", ["gguf", "random int4 with an int4 head"])
def test_logits_agree_with_the_eager_path(gguf, which: str) -> None:
    """Teacher-forced, 16 positions: the native step's logits within bfloat16's rounding of the eager path's
    (the same kernels; a norm's sum in another order can flip a rounding), the same argmax wherever the eager
    path's top two are apart by more than that."""
    model = gguf[0] if which == "gguf" else _random_int4()
    if which == "gguf":  # text: the model is sure of many next tokens
        prompt = gguf[1].encode(TEXT)[:40]
    else:
        prompt = _prompts(model.config.vocab_size, (40,))[0]
    tokens = prompt + _generate(model, [prompt], enforce_eager=True)[0][0]
    native, stats = _teacher_forced_logits(model, tokens, 40, native_step=True, block_size=MAX_TOKENS)
    eager, eager_stats = _teacher_forced_logits(model, tokens, 40, enforce_eager=True, block_size=MAX_TOKENS)
    assert stats.native_step and stats.num_native_steps == 15 and eager_stats.num_native_steps == 0  # all but the first
    scale = eager.abs().amax(dim=1)  # (positions,)
    assert ((native - eager).abs().amax(dim=1) <= 0.05 * scale + 0.25).all()
    top2 = eager.topk(2, dim=1).values
    clear = top2[:, 0] - top2[:, 1] > 0.05 * scale + 0.5
    assert (native.argmax(1) == eager.argmax(1))[clear].all()
    assert clear.sum() >= 4 or which != "gguf"  # the random model's logits are flat: few clear winners


# Where two paths' bfloat16 logits may differ: two roundings of a logit between 16 and 32 (an ulp there is 0.125),
# the bundled model's largest logits. Two tokens this close are a tie that either path may break its own way.
BF16_TIE = 0.25


def assert_same_to_rounding(reference, other, tie: float = BF16_TIE) -> int:
    """Two greedy completions (with logprobs=2) of paths whose kernels round differently in half precision: the
    same tokens as far as they go, and where they part, the reference's two likeliest tokens were within `tie` of
    each other (a tie that a rounding flips), the other path's choice one of them. The tokens they share."""
    same = next((i for i, (a, b) in enumerate(zip(reference.token_ids, other.token_ids)) if a != b),
                min(len(reference.token_ids), len(other.token_ids)))
    if same < min(len(reference.token_ids), len(other.token_ids)):
        entry = reference.logprobs[same]
        chosen, theirs = reference.token_ids[same], other.token_ids[same]
        assert theirs in entry and entry[chosen] - entry[theirs] <= tie, (same, entry, theirs)
    return same


@needs_int4
def test_the_chat_answer_and_the_eager_tokens(gguf) -> None:
    """The GGUF model's chat answer, native and eager: the same greedy tokens, and where they part (a norm's sum in
    another order flips a bfloat16 rounding now and then), a tie of the eager path's two likeliest tokens. Which
    answer a half-precision model gives depends on the CPU's kernels (on one AMD EPYC its first token is a tie in
    bfloat16, and the answer is not "Paris"): the answer's text is asserted in float32
    (test_dense_float32_gives_the_eager_and_compiled_tokens)."""
    model, tokenizer = gguf
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=2)
    outputs = {}
    for name, options in (("native", {"native_step": True}), ("eager", {"enforce_eager": True})):
        llm = LLM.from_model(model, tokenizer, kv_cache_memory=POOL, **options)
        try:
            outputs[name] = llm.chat(messages, params, use_tqdm=False)[0].outputs[0]
            assert (llm.llm_engine.stats().num_native_steps > 0) == (name == "native")
        finally:
            llm.shutdown()
    assert assert_same_to_rounding(outputs["eager"], outputs["native"]) >= 4


@needs_int4
@pytest.mark.parametrize("which", ["gguf", "random int4 with an int4 head"])
def test_each_row_alone_whatever_the_batch(gguf, which: str) -> None:
    """Every step native (prompts in chunks of at most MAX_TOKENS tokens): a row's numbers do not depend on the
    rows beside it, so each request's greedy tokens are exactly its tokens alone, batched with chunked prompts,
    with n-gram drafts verified (k + 1 rows of one sequence in a step) and with prefix hits."""
    model = gguf[0] if which == "gguf" else _random_int4(1)
    prompts = _prompts(model.config.vocab_size, (5, 12, 3, 9, 16, 7))
    shared = prompts[1][:8]
    prompts += [shared + p[:4] for p in prompts[:3]]  # prefix hits on a cached block of 8... and of 16 tokens
    alone = [_generate(model, [p], max_num_batched_tokens=MAX_TOKENS, max_num_seqs=1,
                       enable_prefix_caching=False)[0][0] for p in prompts]
    runs = {
        "batched": dict(max_num_batched_tokens=MAX_TOKENS, max_num_seqs=8, enable_prefix_caching=False),
        "prefix hits": dict(max_num_batched_tokens=MAX_TOKENS, max_num_seqs=8, block_size=4),
        "drafts": dict(max_num_batched_tokens=MAX_TOKENS, max_num_seqs=3,
                       speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                           "prompt_lookup_min": 1, "prompt_lookup_max": 2}),
    }
    for name, options in runs.items():
        tokens, (stats, num_steps) = _generate(model, prompts, **options)
        assert tokens == alone, name
        assert stats.num_native_steps == num_steps and stats.num_compiled_steps == 0, name
        if name == "prefix hits":
            assert stats.prefix_cache_hit_tokens > 0
        if name == "drafts":
            assert stats.num_accepted_tokens > 0


@needs_int4
def test_where_it_runs_and_why_not(gguf) -> None:
    model = gguf[0]
    assert native_step_unavailable_reason(model, "auto") is None
    assert "int8" in native_step_unavailable_reason(model, "int8")
    int8, _ = load_model(None, quantization="int8")
    assert "dense layers" in native_step_unavailable_reason(int8, "auto")
    with pytest.raises(ValueError, match="native_step=True, but"):
        LLM.from_model(int8, None, kv_cache_memory=POOL, native_step=True)
    with pytest.raises(ValueError, match="enforce_eager"):
        LLM.from_model(model, None, kv_cache_memory=POOL, native_step=True, enforce_eager=True)
    for options, expected in (({}, True), ({"native_step": False}, False), ({"enforce_eager": True}, False),
                              ({"kv_cache_dtype": "int8"}, False)):
        llm = LLM.from_model(model, None, kv_cache_memory=POOL, **options)
        try:
            assert llm.llm_engine.stats().native_step == expected, options
        finally:
            llm.shutdown()


@needs_int4
def test_long_steps_and_prompt_logprobs_run_otherwise(gguf) -> None:
    """A prompt longer than MAX_TOKENS (one step) and a request wanting prompt logprobs are not native steps;
    the decodes after them are."""
    model = gguf[0]
    prompt = _prompts(model.config.vocab_size, (MAX_TOKENS + 9,))[0]
    for params, native_steps in ((SamplingParams(temperature=0, max_tokens=4), 3),
                                 (SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1), 3)):
        tokens, (stats, _) = _generate(model, [prompt], params)
        assert stats.num_native_steps == native_steps and len(tokens[0]) == 4
    short = prompt[:6]
    _, (stats, _) = _generate(model, [short], SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1))
    assert stats.num_native_steps == 3  # the prompt's step wanted its logprobs: run otherwise


@pytest.fixture(scope="module")
def dense():
    return {dtype: load_model(dtype=dtype) for dtype in ("float32", "bfloat16")}


@needs_dense
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dense_logits_agree_with_the_eager_path(dense, dtype: str, monkeypatch) -> None:
    """Dense weights, teacher-forced over 16 positions: within float32's rounding of the eager path (its sums
    in another order), within bfloat16's in bfloat16; the same argmax wherever the top two are apart. Steps of
    up to MAX_TOKENS tokens in both dtypes (bfloat16's default, batch-1 steps only, would run most otherwise)."""
    monkeypatch.setattr(native_step, "DENSE_BF16_MAX_TOKENS", MAX_TOKENS)
    model, tokenizer = dense[dtype]
    prompt = tokenizer.encode(TEXT)[:40]
    tokens = prompt + _generate(model, [prompt], enforce_eager=True)[0][0]
    native, stats = _teacher_forced_logits(model, tokens, 40, native_step=True, block_size=MAX_TOKENS)
    eager, _ = _teacher_forced_logits(model, tokens, 40, enforce_eager=True, block_size=MAX_TOKENS)
    assert stats.native_step and stats.num_native_steps == 15
    scale = eager.abs().amax(dim=1)  # (positions,)
    tolerance = (1e-4 * scale + 1e-3) if dtype == "float32" else (0.05 * scale + 0.25)
    assert ((native - eager).abs().amax(dim=1) <= tolerance).all()
    top2 = eager.topk(2, dim=1).values
    clear = top2[:, 0] - top2[:, 1] > tolerance + (0.25 if dtype == "bfloat16" else 0.0)
    assert clear.sum() >= 3 and (native.argmax(1) == eager.argmax(1))[clear].all()


@needs_dense
def test_dense_float32_gives_the_eager_and_compiled_tokens(dense) -> None:
    """float32: the greedy tokens of the eager path and of the compiled forward pass, on text prompts; the
    engine that owns its model leaves its weights plain for the native step (not packed: no second copy)."""
    model, tokenizer = dense["float32"]
    prompts = [tokenizer.encode(text) for text in (TEXT, "def fibonacci(n):", "The capital of France is")]
    prompts.append(encode_chat(tokenizer, [{"role": "user", "content": "What is the capital of France?"}]))
    native, (stats, _) = _generate(model, prompts, native_step=True)
    assert stats.num_native_steps > 0 and not stats.prepacked_weights
    assert native == _generate(model, prompts, enforce_eager=True)[0]
    assert native == _generate(model, prompts, compile_model=True, native_step=False)[0]
    assert tokenizer.decode(native[-1]).startswith("The capital of France is Paris.")  # float32: on any CPU


@needs_dense
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dense_rows_alone_whatever_the_batch(dense, dtype: str, monkeypatch) -> None:
    """Every step native: each request's greedy tokens exactly its tokens alone, batched with chunked prompts,
    with n-gram drafts verified and with prefix hits. (Dense bfloat16 runs batch-1 steps only by default,
    `DENSE_BF16_MAX_TOKENS`: here its steps of up to MAX_TOKENS, the kernel's property.)"""
    monkeypatch.setattr(native_step, "DENSE_BF16_MAX_TOKENS", MAX_TOKENS)
    model = dense[dtype][0]
    prompts = _prompts(model.config.vocab_size, (5, 12, 3, 9, 16, 7))
    prompts += [prompts[1][:8] + p[:4] for p in prompts[:3]]
    alone = [_generate(model, [p], max_num_batched_tokens=MAX_TOKENS, max_num_seqs=1,
                       enable_prefix_caching=False)[0][0] for p in prompts]
    for name, options in {
        "batched": dict(max_num_batched_tokens=MAX_TOKENS, max_num_seqs=8, enable_prefix_caching=False),
        "prefix hits": dict(max_num_batched_tokens=MAX_TOKENS, max_num_seqs=8, block_size=4),
        "drafts": dict(max_num_batched_tokens=MAX_TOKENS, max_num_seqs=3,
                       speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                           "prompt_lookup_min": 1, "prompt_lookup_max": 2}),
    }.items():
        tokens, (stats, num_steps) = _generate(model, prompts, **options)
        assert tokens == alone, name
        assert stats.num_native_steps == num_steps, name


@needs_dense
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_packed_weights_get_a_plain_copy_that_the_budget_counts(dtype: str) -> None:
    """Asked to pack (prepack_weights=True), the engine packs the model in place and the native step reads a
    plain copy, which the memory book counts; the tokens are the plain model's. Not asked, an owned model stays
    plain and the native step's weights are the model's own tensors (counted once). The two engines' prompts run
    through oneDNN's packed and plain products, whose roundings differ: in bfloat16 the tokens agree to that
    rounding (the same until a tie), in float32 exactly."""
    model, tokenizer = load_model(dtype=dtype)
    prompt = [tokenizer.encode(TEXT)[:24]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    before = CPU_DEVICE.held_bytes(model.device)  # other tests' engines still alive
    # compile_model=False: the prompts run eagerly (compiling two graphs would be most of this test's time)
    plain_llm = LLM.from_model(model, None, kv_cache_memory=POOL, owns_model=True, compile_model=False)
    try:
        engine = plain_llm.llm_engine
        assert engine.stats().native_step and not engine.stats().prepacked_weights
        assert engine.model_runner.native.max_tokens == (1 if dtype == "bfloat16" else MAX_TOKENS)  # (dense bf16)
        assert tensor_bytes(engine.native_weights) > 0
        # the same storages as the model's: nothing copied, and the memory book counts them once
        assert CPU_DEVICE.held_bytes(model.device) - before == engine.kv_pool_bytes + tensor_bytes(model)
        expected = plain_llm.generate([{"prompt_token_ids": p} for p in prompt], params, use_tqdm=False)
    finally:
        plain_llm.shutdown()
    before = CPU_DEVICE.held_bytes(model.device)
    packed_llm = LLM.from_model(model, None, kv_cache_memory=POOL, prepack_weights=True, compile_model=False)
    try:
        engine = packed_llm.llm_engine
        assert engine.stats().native_step and engine.stats().prepacked_weights
        held = CPU_DEVICE.held_bytes(model.device) - before
        assert held > engine.kv_pool_bytes + tensor_bytes(model)  # the plain copy counts too
        got = packed_llm.generate([{"prompt_token_ids": p} for p in prompt], params, use_tqdm=False)
        assert engine.stats().num_native_steps > 0
    finally:
        packed_llm.shutdown()
    plain, packed = expected[0].outputs[0], got[0].outputs[0]
    if dtype == "float32":
        assert packed.token_ids == plain.token_ids
    else:
        assert assert_same_to_rounding(plain, packed) >= 4


def _captured_step(model, **options):
    """(engine, its NativeStep, a copy of one decode step's ModelInput it ran), the engine still alive."""
    import copy

    llm = LLM.from_model(model, None, kv_cache_memory=POOL, native_step=True, **options)
    native, seen = llm.llm_engine.model_runner.native, []
    run = native.run

    def spy(model_input):
        seen.append(copy.deepcopy(model_input))
        return run(model_input)

    native.run = spy
    llm.generate([{"prompt_token_ids": _prompts(model.config.vocab_size, (20,))[0]}],
                 SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    native.run = run
    return llm, native, seen[-1]


@needs_dense
def test_a_step_out_of_bounds_is_refused_before_anything_is_read_or_written(dense) -> None:
    """Indices past what they index (a slot past the pool, a block table entry past it, a token id past the
    vocabulary, a position past the rotary tables, a logits row past the step, query starts that do not split
    the rows) are refused with a ValueError naming them, the pool untouched; before, the C side wrote and read
    wherever they pointed."""
    import dataclasses

    model = dense["float32"][0]
    llm, native, good = _captured_step(model)
    try:
        pool = llm.llm_engine.kv_cache
        before = [layer.clone() for layer in pool.keys]
        meta, slots = good.metadata, pool.num_blocks * pool.block_size
        tables = meta.block_tables.clone()
        tables[0, 0] = pool.num_blocks
        starts = meta.query_start_loc.clone()
        starts[-1] += 1
        broken = {
            "a slot outside the KV pool": dataclasses.replace(good, metadata=dataclasses.replace(
                meta, slot_mapping=torch.full_like(meta.slot_mapping, slots))),
            "a block table entry outside the KV pool": dataclasses.replace(good, metadata=dataclasses.replace(
                meta, block_tables=tables)),
            "a token id outside the vocabulary": dataclasses.replace(
                good, input_ids=torch.full_like(good.input_ids, model.config.vocab_size)),
            "a position outside the model's rotary tables": dataclasses.replace(
                good, positions=torch.full_like(good.positions, 10**9)),
            "a logits row outside the step": dataclasses.replace(
                good, logits_indices=torch.full_like(good.logits_indices, good.num_tokens)),
            "query_start_loc does not split": dataclasses.replace(good, metadata=dataclasses.replace(
                meta, query_start_loc=starts)),
        }
        for what, step in broken.items():
            with pytest.raises(ValueError, match=what):
                native.run(step)
            assert all(torch.equal(a, b) for a, b in zip(before, pool.keys)), what
        assert native.run(good) is not None  # the good step still runs
    finally:
        llm.shutdown()


@needs_dense
def test_the_step_holds_what_it_points_at_and_leaves_with_the_engine(dense) -> None:
    """Every address the C side keeps is a tensor the step holds (a model repacked or a pool released later
    cannot leave it pointing at freed memory); the engine's shutdown drops the step with its pool."""
    model = dense["float32"][0]
    llm, native, _ = _captured_step(model)
    held = {tensor.data_ptr() for tensor in native._keep}
    pointers = [getattr(native._model, name) for name, kind in native_step._Model._fields_ if kind is native_step._P]
    for layer in native._layers:
        pointers += [layer.input_norm, layer.post_norm, layer.key_pool, layer.value_pool]
        pointers += [p for weight in (layer.dqkv, layer.dout, layer.dgate_up, layer.ddown) for p in weight.part]
    assert [p for p in pointers if p and p not in held] == []
    llm.shutdown()
    assert llm.llm_engine.model_runner.native is None and llm.llm_engine.native_weights is None


@needs_int4
def test_q8_tables_of_another_shape_are_refused(gguf) -> None:
    """A Q8_0 table whose vocabulary or width is not the config's (the C side strides by the config) is refused
    where the step is built, not read past its end."""
    import copy

    model = copy.deepcopy(gguf[0])
    table = model.model.embed_tokens.table
    table.q = table.q[:, :-64].contiguous()  # 64 tokens fewer than the config's vocabulary
    with LLM.from_model(gguf[0], None, kv_cache_memory=POOL, native_step=False) as llm:
        with pytest.raises(ValueError, match="Q8_0 embedding"):
            native_step.NativeStep(model, llm.llm_engine.kv_cache, 256)
