"""LLMEngine: continuous batching gives every request exactly its tokens when run alone.

The backbone: float64 tiny models of every family, 36 requests with prompts of 1 to 300 tokens,
varied max_tokens, a small token budget (so long prompts are prefilled in chunks alongside other
requests' decodes) and requests arriving while others run.
"""

from __future__ import annotations

import random

import pytest
import torch

from conftest import TINY_FAMILIES
from llm_runtime import EngineConfig, LLMEngine, SamplingParams, generate


def make_workload(vocab_size: int, num_requests: int = 36, seed: int = 0) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    lengths = [1, 2, 300, 299, 150] + [rng.randint(1, 300) for _ in range(num_requests - 5)]
    workload = []
    for i, length in enumerate(lengths):
        prompt = [rng.randrange(3, vocab_size) for _ in range(length)]
        params = SamplingParams(temperature=0, max_tokens=rng.randint(1, 40), ignore_eos=i % 3 != 0)
        workload.append((prompt, params))
    return workload


def run_engine(engine: LLMEngine, workload, arrive_every: int = 3) -> dict[str, list[int]]:
    """Add the first third up front, then one more request every `arrive_every` steps."""
    pending = list(enumerate(workload))
    upfront = len(pending) // 3
    for i, (prompt, params) in pending[:upfront]:
        engine.add_request(str(i), prompt, params)
    pending = pending[upfront:]
    results: dict[str, list[int]] = {}
    step = 0
    while engine.has_unfinished_requests() or pending:
        if pending and step % arrive_every == 0:
            i, (prompt, params) = pending.pop(0)
            engine.add_request(str(i), prompt, params)
        for output in engine.step():
            if output.finished:
                results[output.request_id] = output.outputs[0].token_ids
        step += 1
    return results


@pytest.mark.parametrize("family", list(TINY_FAMILIES))
def test_continuous_batching_equals_each_request_alone(tiny_pairs, family: str) -> None:
    model, _ = tiny_pairs[family]
    workload = make_workload(model.config.vocab_size)
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=96, record_steps=True)
    engine = LLMEngine(model, None, config)
    results = run_engine(engine, workload)
    assert len(results) == len(workload)
    for i, (prompt, params) in enumerate(workload):
        assert results[str(i)] == generate(model, prompt, params), f"request {i} (prompt {len(prompt)} tokens)"
    # The run really mixed things: chunked prefills next to decodes, and never over the caps.
    records = engine.step_records
    assert max(sum(n for *_, n, _ in r.items) for r in records) <= 96
    assert max(len(r.items) for r in records) <= 8
    assert any(any(p for *_, p in r.items) and not all(p for *_, p in r.items) for r in records)
    assert not engine.scheduler.running and not engine.scheduler.waiting


def test_seeded_request_is_the_same_whatever_else_runs(tiny_pairs) -> None:
    model, _ = tiny_pairs["qwen3"]
    target = ([5, 6, 7, 8], SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=25, ignore_eos=True))

    def run(others: int) -> list[int]:
        engine = LLMEngine(model, None, EngineConfig(max_num_seqs=16, max_num_batched_tokens=64, seed=others))
        rng = random.Random(others)
        for j in range(others):
            engine.add_request(f"other{j}", [rng.randrange(3, 90) for _ in range(rng.randint(1, 40))],
                               SamplingParams(temperature=1.0, max_tokens=rng.randint(1, 30)))
        engine.add_request("target", *target)
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.request_id == "target" and output.finished:
                    return output.outputs[0].token_ids
        raise AssertionError("target never finished")

    alone = run(0)
    assert run(5) == alone and run(12) == alone
    assert alone == generate(model, *target)


def test_max_tokens_stop_token_ids_min_tokens_and_eos(tiny_pairs) -> None:
    model, _ = tiny_pairs["llama2"]
    prompt = [9, 10, 11, 12]
    free = generate(model, prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    engine = LLMEngine(model, None, EngineConfig(max_num_seqs=4, max_num_batched_tokens=32))
    stop_token = free[5]
    first = free.index(stop_token)
    cases = {
        "length": SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
        "stop_id": SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_token]),
        "min_tokens": SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_token],
                                     min_tokens=first + 3),
    }
    for request_id, params in cases.items():
        engine.add_request(request_id, prompt, params)
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o.outputs[0] for o in engine.step() if o.finished})
    assert outputs["length"].token_ids == free[:7] and outputs["length"].finish_reason == "length"
    assert outputs["stop_id"].token_ids == free[: first + 1]
    assert outputs["stop_id"].finish_reason == "stop" and outputs["stop_id"].stop_reason == stop_token
    held = outputs["min_tokens"].token_ids
    assert len(held) >= first + 3 and stop_token not in held[: first + 3]


def test_abort_mid_flight_and_unknown_id(tiny_pairs) -> None:
    model, _ = tiny_pairs["llama2"]
    engine = LLMEngine(model, None, EngineConfig(max_num_seqs=4, max_num_batched_tokens=64))
    engine.add_request("keep", [1, 2, 3], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    engine.add_request("drop", [4, 5, 6], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    engine.step()
    engine.step()
    dropped = [s for s in engine.scheduler.running if s.request_id == "drop"][0]
    engine.abort_request("drop")
    assert dropped.status.finish_reason == "abort" and not engine.block_manager.has_blocks(dropped)
    assert all(s.request_id != "drop" for s in engine.scheduler.running)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["keep"]
    assert finished[0].outputs[0].token_ids == generate(model, [1, 2, 3], SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True))
    with pytest.raises(ValueError, match="unknown request id"):
        engine.abort_request("drop")
    with pytest.raises(ValueError, match="unknown request id"):
        engine.abort_request("never-added")


def test_bad_input_is_refused_and_the_engine_keeps_serving(tiny_pairs) -> None:
    model, _ = tiny_pairs["qwen2"]
    context = model.config.max_position_embeddings
    engine = LLMEngine(model, None, EngineConfig(max_num_seqs=4, max_num_batched_tokens=64))
    good = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    engine.add_request("a", [1, 2, 3], good)
    engine.step()
    bad = {
        "empty": ([], good, "empty"),
        "too long": ([5] * context, good, "context"),
        "out of vocab": ([1, model.config.vocab_size + 3], good, r"\[0, 97\)"),
        "negative id": ([1, -1], good, "integers"),
        "not a prompt": (42, good, "string or a list"),
        "bytes": (b"abc", good, "string or a list"),
        "text without tokenizer": ("hello", good, "tokenizer"),
        "max_tokens past context": ([1] * 10, SamplingParams(max_tokens=context - 5), "max_tokens"),
        "not params": ([1, 2], {"max_tokens": 3}, "SamplingParams"),
    }
    for request_id, (prompt, params, message) in bad.items():
        with pytest.raises(ValueError, match=message):
            engine.add_request(request_id, prompt, params)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", [1], good)
    engine.add_request("b", [4, 5], good)
    results = {}
    while engine.has_unfinished_requests():
        results.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    assert set(results) == {"a", "b"}
    assert results["a"] == generate(model, [1, 2, 3], good) and results["b"] == generate(model, [4, 5], good)


def test_parallel_sampling_n(tiny_pairs) -> None:
    model, _ = tiny_pairs["qwen3"]
    engine = LLMEngine(model, None, EngineConfig())
    engine.add_request("r", [1, 2, 3], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=15, ignore_eos=True))
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.finished), final)
    assert final is not None and [c.index for c in final.outputs] == [0, 1, 2]
    texts = [tuple(c.token_ids) for c in final.outputs]
    assert len(set(texts)) == 3  # seeds 7, 8, 9
    assert list(texts[0]) == generate(model, [1, 2, 3], SamplingParams(temperature=1.0, seed=7, max_tokens=15,
                                                                         ignore_eos=True))


@pytest.mark.parametrize("config", [dict(max_num_seqs=0), dict(max_num_batched_tokens=0),
                                    dict(max_num_seqs=8, max_num_batched_tokens=4), dict(max_model_len=1)])
def test_engine_config_is_validated(config: dict) -> None:
    with pytest.raises(ValueError):
        EngineConfig(**config)


def test_chunked_prefill_off_waits_for_room(tiny_pairs) -> None:
    model, _ = tiny_pairs["llama2"]
    engine = LLMEngine(model, None, EngineConfig(max_num_seqs=4, max_num_batched_tokens=50,
                                                  enable_chunked_prefill=False, record_steps=True))
    engine.add_request("short", [1] * 10, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    engine.add_request("long", [2] * 45, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    first_long = next(r for r in engine.step_records if any(i[0] == "long" for i in r.items))
    assert [i[2] for i in first_long.items if i[0] == "long"] == [45]  # whole prompt in one step


def test_prompt_logprobs_equal_a_full_forward_pass_even_in_chunks_and_after_a_cache_hit(tiny_pairs) -> None:
    model, _ = tiny_pairs["llama3"]
    prompt = [(7 * i) % 90 + 3 for i in range(70)]
    with torch.no_grad():
        expected = model.compute_logits(model(torch.tensor([prompt]))).log_softmax(-1)[0]  # (T, vocab)
    engine = LLMEngine(model, None, EngineConfig(max_num_seqs=4, max_num_batched_tokens=24, block_size=16))
    engine.add_request("warm", prompt, SamplingParams(max_tokens=1))  # its blocks are cached afterwards
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("p", prompt, SamplingParams(max_tokens=2, prompt_logprobs=3))
    final = [o for _ in range(100) for o in engine.step() if o.finished][0]
    logprobs = final.prompt_logprobs
    assert logprobs[0] is None and len(logprobs) == len(prompt)
    for position in range(1, len(prompt)):
        entry = logprobs[position]
        assert abs(entry[prompt[position]] - expected[position - 1, prompt[position]].item()) < 1e-5  # float32
        top = expected[position - 1].topk(3)
        assert all(abs(entry[i] - v) < 1e-5 for i, v in zip(top.indices.tolist(), top.values.tolist()))


def test_stats_read_counters_and_never_walk_the_model(tiny_pairs, monkeypatch) -> None:
    """A server takes the engine's stats after every step: they must cost what reading counters costs. How the model
    was set up (packed weights, pointwise ops) is read once, when the engine is built: walking its modules took
    0.3 ms a call on the bundled model, two or three calls a step (found profiling the live view's feed)."""
    model, _ = tiny_pairs["llama3"]
    engine = LLMEngine(model, None, EngineConfig(num_kv_blocks=8))
    expected = engine.stats()

    def walked(*args, **kwargs):
        raise AssertionError("stats() walked the model's modules")

    monkeypatch.setattr(torch.nn.Module, "modules", walked)
    monkeypatch.setattr(torch.nn.Module, "named_modules", walked)
    engine.add_request("r", [5, 6, 7], SamplingParams(temperature=0, max_tokens=2))
    engine.step()
    stats = engine.stats()
    assert (stats.prepacked_weights, stats.pointwise_ops) == (expected.prepacked_weights, expected.pointwise_ops)
    assert stats.num_running == 1
