"""Batch invariance (model/batch_invariant.py, lesson 16), in bfloat16 on the CPU, compared bit for bit.

With `batch_invariant=True` a request's greedy tokens and the logprobs of each are the same alone and inside a
busy batch of 24 (8 of them checked), whatever else the batch holds and however it runs: prompts chunked across steps beside decodes,
prefill chunks and decodes in one step, prefix-cache hits, speculation, a smaller decode batch. Seeded sampling
gives the same tokens too, and the logprobs a scoring pass computes over prompt + completion (prompt_logprobs:
every token in a prefill chunk) equal the ones generation reported one decode step at a time. The default mode,
on the same workload, is shown to differ (so these comparisons can fail), and the settings the mode cannot run
with are refused.
"""

from __future__ import annotations

import pytest
import torch

from llm_runtime import LLM, EngineConfig, LLMEngine, SamplingParams, encode_chat, load_model
from llm_runtime.model.packed_linear import PackedLinear, packing_unsupported_reason

pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of France?", "Write a haiku about autumn.", "Name three colors.",
             "Explain gravity simply.", "List the days of the week.", "What is 12 times 7?", "Tell me a joke.",
             "Describe a cat.", "Why is the sky blue?", "Give me a recipe for tea.", "What is Python?",
             "Who wrote Hamlet?", "Translate hello to French.", "What is a prime number?", "Write a limerick.",
             "How do planes fly?", "Name a planet.", "What is the largest ocean?", "Say hello in Spanish.",
             "Count to five.", "What colour is grass?", "Give me a word that rhymes with cat.",
             "What is rain?", "Describe the moon."]
SUBJECTS = 8  # the requests also run alone, each through an engine of its own, and compared
DEFAULT_SUBJECTS = 6  # the default mode's comparison needs only some
KV = 256 << 20
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def bf16():
    """The bundled model in bfloat16 (its own copy: batch-invariant engines pack its linears in place)."""
    model, tokenizer = load_model(None, device="cpu", dtype="bfloat16")
    reason = packing_unsupported_reason(model)
    if reason is not None:
        pytest.skip(f"batch invariance needs packed linears: {reason}")
    return model, tokenizer


@pytest.fixture(scope="module")
def prompts(bf16) -> list[list[int]]:
    return [encode_chat(bf16[1], [{"role": "user", "content": q}]) for q in QUESTIONS]


def _requests(bf16, prompts: list[list[int]], params: list[SamplingParams], **options):
    """Every prompt at once through one engine: the RequestOutputs, in order."""
    model, tokenizer = bf16
    with LLM.from_model(model, tokenizer, kv_cache_memory=KV, **options) as llm:
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _run(bf16, prompts: list[list[int]], params: list[SamplingParams], **options):
    """Every prompt at once through one engine: the completions, in order."""
    return [o.outputs[0] for o in _requests(bf16, prompts, params, **options)]


def _alone(bf16, prompts: list[list[int]], params: list[SamplingParams], **options):
    """Each prompt through an engine of its own, with nothing beside it."""
    return [_run(bf16, [prompt], [p], **options)[0] for prompt, p in zip(prompts, params)]


def _bits(output) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """The tokens and the logprob of each: Python floats hold a float32 exactly, so == is bitwise."""
    return tuple(output.token_ids), tuple(entry[token] for entry, token in zip(output.logprobs, output.token_ids))


def _greedy(n: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=24, logprobs=0)] * n


@pytest.fixture(scope="module")
def alone_greedy(bf16, prompts):
    return [_bits(o) for o in _alone(bf16, prompts[:SUBJECTS], _greedy(SUBJECTS), batch_invariant=True,
                                     enable_prefix_caching=False)]


@pytest.mark.parametrize("options", [
    {},
    {"max_num_batched_tokens": 64},  # prompts chunked over several steps, beside the decodes
    {"max_num_seqs": 5},  # smaller decode batches; later requests hit the shared template's blocks
    {"speculative_config": NGRAM, "max_num_batched_tokens": 96},
], ids=["busy-24", "chunked", "waves-prefix-hits", "speculation"])
def test_greedy_tokens_and_logprobs_are_the_same_alone_and_in_a_busy_batch(bf16, prompts, alone_greedy,
                                                                            options: dict) -> None:
    busy = _run(bf16, prompts, _greedy(len(prompts)), batch_invariant=True, **options)
    assert [_bits(o) for o in busy[:SUBJECTS]] == alone_greedy


def test_prefix_hits_and_the_subjects_place_in_the_batch_change_nothing(bf16, prompts, alone_greedy) -> None:
    model, tokenizer = bf16
    order = list(range(len(prompts)))[::-1]  # the other way round: each request's neighbours change
    engine = LLMEngine(model, tokenizer, EngineConfig(batch_invariant=True, kv_cache_memory=KV, max_num_seqs=7))
    try:
        for round_ in range(2):  # the second round's prompts are all in the prefix cache
            for i in order:
                engine.add_request(f"{round_}-{i}", prompts[i], _greedy(1)[0])
            finished = {}
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        finished[output.request_id] = output.outputs[0]
            assert [_bits(finished[f"{round_}-{i}"]) for i in range(SUBJECTS)] == alone_greedy
        assert engine.stats().prefix_cache_hit_tokens > 0
    finally:
        engine.shutdown()


def test_seeded_sampling_is_the_same_alone_and_in_a_busy_batch(bf16, prompts) -> None:
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=20, logprobs=0)
              for i in range(len(prompts))]
    alone = [_bits(o) for o in _alone(bf16, prompts[:DEFAULT_SUBJECTS], params[:DEFAULT_SUBJECTS],
                                      batch_invariant=True)]
    busy = _run(bf16, prompts, params, batch_invariant=True, max_num_batched_tokens=64)
    assert [_bits(o) for o in busy[:DEFAULT_SUBJECTS]] == alone


def test_a_scoring_pass_reproduces_the_generations_logprobs(bf16, prompts) -> None:
    """Prefill against decode: prompt_logprobs over prompt + completion, each token's logprob from a row of a
    prefill chunk, against the logprobs generation reported from decode steps (the check RL training needs)."""
    generated = _run(bf16, prompts[:8], _greedy(8), batch_invariant=True)
    full = [prompt + list(o.token_ids) for prompt, o in zip(prompts, generated)]
    scored = _requests(bf16, full, [SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)] * len(full),
                  batch_invariant=True, max_num_batched_tokens=80)
    for prompt, gen, score in zip(prompts, generated, scored):
        rescored = tuple(score.prompt_logprobs[len(prompt) + i][t] for i, t in enumerate(gen.token_ids))
        assert rescored == _bits(gen)[1]


def test_the_default_mode_differs_on_the_same_workload(bf16, prompts) -> None:
    """Without the mode a lone row goes through oneDNN's matrix-vector kernel and long chunks attend block-wise:
    some subject's tokens or logprobs change between alone and busy (measured here: most of them)."""
    fresh_model, tokenizer = load_model(None, device="cpu", dtype="bfloat16")  # unpacked: nn.Linear, MKL
    alone = [_bits(o) for o in _alone((fresh_model, tokenizer), prompts[:DEFAULT_SUBJECTS], _greedy(DEFAULT_SUBJECTS))]
    busy = _run((fresh_model, tokenizer), prompts, _greedy(len(prompts)))
    assert [_bits(o) for o in busy[:DEFAULT_SUBJECTS]] != alone


def test_a_lone_row_gets_the_bits_of_any_larger_product(bf16) -> None:
    """The linear layers of a batch-invariant engine: a row alone gives the bits it gets in any larger product,
    by the rule the probe measured for this CPU (a lone row as two, or fixed tiles of rows where oneDNN's AMX
    kernels change with the row count)."""
    model, tokenizer = bf16
    LLMEngine(model, tokenizer, EngineConfig(batch_invariant=True, kv_cache_memory=16 << 20)).shutdown()
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert layers and all(m.single_row_as_two != (m.row_tile is not None) for m in layers)
    down = model.model.layers[0].mlp.down_proj
    rows = torch.randn(64, down.in_features, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch.inference_mode():
        together = down(rows)  # (64, hidden)
        one_by_one = torch.cat([down(rows[i : i + 1]) for i in range(len(rows))])
        in_threes = torch.cat([down(rows[i : i + 3]) for i in range(0, len(rows), 3)])
    assert torch.equal(one_by_one, together) and torch.equal(in_threes, together)
    exact = rows.double() @ down.weight.double().T  # the rule changes how rows are grouped, not what is computed
    assert (together.double() - exact).abs().max().item() < 0.1 * exact.abs().max().item() / 8


@pytest.mark.parametrize("options, message", [
    ({"compile_model": True}, "compile_model"),
    ({"prepack_weights": False}, "prepack_weights=False"),
])
def test_settings_the_mode_cannot_run_with_are_refused(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(batch_invariant=True, **options)


def test_a_model_it_cannot_pack_or_another_attention_backend_is_refused(tiny_pairs, bf16) -> None:
    tiny, _ = tiny_pairs["llama3"]  # float64: oneDNN packs float32 and bfloat16 only
    with pytest.raises(ValueError, match="batch-invariant mode runs on cpu in torch.float64"):
        LLMEngine(tiny, None, EngineConfig(batch_invariant=True, num_kv_blocks=16))
    model, tokenizer = bf16
    with pytest.raises(ValueError, match="no batch-invariant mode"):
        LLMEngine(model, tokenizer, EngineConfig(batch_invariant=True, attention_backend="blockwise",
                                                 kv_cache_memory=16 << 20))


def test_float32_is_invariant_too(prompts) -> None:
    """The same mode in float32 (oneDNN's float32 products behave as its bfloat16 ones: one row apart)."""
    model, tokenizer = load_model(None, device="cpu", dtype="float32")  # its own copy: the mode packs it
    f32 = (model, tokenizer)
    alone = [_bits(o) for o in _alone(f32, prompts[:DEFAULT_SUBJECTS], _greedy(DEFAULT_SUBJECTS),
                                      batch_invariant=True)]
    busy = _run(f32, prompts, _greedy(len(prompts)), batch_invariant=True, max_num_batched_tokens=64)
    assert [_bits(o) for o in busy[:DEFAULT_SUBJECTS]] == alone
