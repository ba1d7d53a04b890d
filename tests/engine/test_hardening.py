"""Requests a careless or hostile client would send, against the engine: each is refused at the door,
or, if a step still fails, only its own request fails and every other request keeps its tokens.

Each test here was written first against the engine before the hardening work, and failed there.
"""

from __future__ import annotations

import random

import pytest
import torch

from llm_runtime import EngineConfig, InvalidRequestError, LLMEngine, Sampler, SamplingParams, generate
from llm_runtime.core import block_manager as block_manager_module
from llm_runtime.core import prefix_cache as prefix_cache_module

def poisoned(model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch, poison: int) -> None:
    """Make `model.forward` raise whenever its batch holds the token `poison` (a bug only one request hits)."""
    forward = type(model).forward

    def failing_forward(self, input_ids, *args, **kwargs):
        if bool((input_ids == poison).any()):
            raise RuntimeError("injected fault: the poison token")
        return forward(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(model, "forward", failing_forward.__get__(model))


def unused_token(vocab_size: int, *token_lists: list[int]) -> int:
    """A token id that none of these prompts or outputs holds: the poison only its own request meets."""
    used = {token for tokens in token_lists for token in tokens}
    return min(set(range(3, vocab_size)) - used)


def prompts(vocab_size: int, count: int, seed: int = 0, length: tuple[int, int] = (3, 40)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randint(*length))] for _ in range(count)]


def drain(engine: LLMEngine, max_steps: int = 2000) -> dict[str, object]:
    finals: dict[str, object] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return finals
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    raise AssertionError(f"requests still unfinished after {max_steps} steps: the engine is stuck")


# ---------------------------------------------------------------------------------------------- input
@pytest.mark.parametrize("params, field", [
    (dict(stop_token_ids=[10_000], min_tokens=2), "stop_token_ids"),
    (dict(stop_token_ids=[96, 97]), "stop_token_ids"),
    (dict(logprobs=21), "logprobs"),
    (dict(logprobs=10**6), "logprobs"),
    (dict(seed=2**64), "seed"),
    (dict(seed=-(2**63) - 1), "seed"),
])
def test_out_of_range_fields_are_refused_before_anything_runs(tiny_pairs, params, field) -> None:
    model, _ = tiny_pairs["llama2"]
    engine = LLMEngine(model, None, EngineConfig(max_num_seqs=4))
    with pytest.raises(ValueError, match=field):
        engine.add_request("bad", [7, 8, 9], SamplingParams(temperature=0, max_tokens=4, **params))
    assert not engine.has_unfinished_requests()
    engine.add_request("good", [7, 8, 9], SamplingParams(temperature=0, max_tokens=4))
    assert drain(engine)["good"].outputs[0].token_ids == generate(model, [7, 8, 9], SamplingParams(temperature=0,
                                                                                                  max_tokens=4))


@pytest.mark.parametrize("prompt", [[7, True, 9], [7, 8.0, 9], [7, -1], [7, 97], "text needs a tokenizer"])
def test_bad_prompt_ids_are_refused(tiny_pairs, prompt) -> None:
    model, _ = tiny_pairs["llama2"]
    engine = LLMEngine(model, None)
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request("bad", prompt, SamplingParams(max_tokens=2))
    assert not engine.has_unfinished_requests()


def test_a_prompt_longer_than_the_step_without_chunked_prefill_is_refused(tiny_pairs) -> None:
    model, _ = tiny_pairs["llama2"]
    engine = LLMEngine(model, None, EngineConfig(max_num_seqs=4, max_num_batched_tokens=32,
                                                 enable_chunked_prefill=False))
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        engine.add_request("long", list(range(10, 50)), SamplingParams(temperature=0, max_tokens=2))
    # A prompt that fits, but whose prompt + output could not be recomputed in one step after a preemption:
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request("grows", list(range(10, 30)), SamplingParams(temperature=0, max_tokens=40))
    engine.add_request("fits", list(range(10, 30)), SamplingParams(temperature=0, max_tokens=8))
    assert drain(engine)["fits"].outputs[0].finish_reason == "length"


@pytest.mark.parametrize("stop, field", [(["x"] * 100, "stop"), (["y" * 10_000], "stop")])
def test_too_many_or_too_long_stop_strings_are_refused(tiny_pairs, bundled_tokenizer, stop, field) -> None:
    model, _ = tiny_pairs["llama2"]
    engine = LLMEngine(model, bundled_tokenizer)
    with pytest.raises(ValueError, match=field):
        engine.add_request("bad", [7, 8, 9], SamplingParams(max_tokens=4, stop=stop))
    assert not engine.has_unfinished_requests()


# ------------------------------------------------------------------------------------------ scheduler
def test_pending_forks_count_against_max_num_seqs(tiny_pairs) -> None:
    """A request with n = 3 whose prompt takes several steps holds 3 slots from admission on."""
    model, _ = tiny_pairs["llama2"]
    engine = LLMEngine(model, None, EngineConfig(max_num_seqs=4, max_num_batched_tokens=16, num_kv_blocks=200))
    engine.add_request("forks", list(range(10, 70)), SamplingParams(n=3, temperature=0, max_tokens=6, ignore_eos=True))
    for i, prompt in enumerate(prompts(model.config.vocab_size, 6, seed=3, length=(2, 5))):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=6))
    while engine.has_unfinished_requests():
        engine.step()
        scheduler = engine.scheduler
        pending = sum(len(children) for parent, children in scheduler.forks.items() if parent in scheduler.running)
        assert len(scheduler.running) + pending <= 4


# ------------------------------------------------------------------------------------------ faults
def test_a_failing_request_fails_alone_and_the_others_keep_their_tokens(tiny_pairs, monkeypatch) -> None:
    model, _ = tiny_pairs["llama2"]
    batch = prompts(model.config.vocab_size, 8, seed=1)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [generate(model, p, params) for p in batch]
    poison = unused_token(model.config.vocab_size, *batch, *expected)
    poisoned(model, monkeypatch, poison)
    engine = LLMEngine(model, None, EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, num_kv_blocks=100))
    for i, prompt in enumerate(batch):
        engine.add_request(str(i), prompt, params)
    engine.add_request("poison", [9, 10, poison, 11], SamplingParams(n=2, temperature=0, max_tokens=12))
    finals = drain(engine)
    assert [c.finish_reason for c in finals["poison"].outputs] == ["error", "error"]
    assert [finals[str(i)].outputs[0].token_ids for i in range(len(batch))] == expected
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == stats.num_waiting == 0


def test_a_failing_request_that_joins_running_decodes_fails_alone(tiny_pairs, monkeypatch) -> None:
    """The faulty request arrives while the others decode: its prefill shares their step, they go on."""
    model, _ = tiny_pairs["llama2"]
    batch = prompts(model.config.vocab_size, 4, seed=2)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    expected = [generate(model, p, params) for p in batch]
    poison = unused_token(model.config.vocab_size, *batch, *expected)
    poisoned(model, monkeypatch, poison)
    engine = LLMEngine(model, None, EngineConfig(max_num_seqs=8))
    for i, prompt in enumerate(batch):
        engine.add_request(str(i), prompt, params)
    engine.step()
    engine.add_request("late-poison", [12, 13, poison], SamplingParams(temperature=0, max_tokens=4))
    finals = drain(engine)
    assert finals["late-poison"].outputs[0].finish_reason == "error"
    assert [finals[str(i)].outputs[0].token_ids for i in range(len(batch))] == expected


def test_a_retried_step_draws_the_same_seeded_noise(tiny_pairs, monkeypatch) -> None:
    """A step that fails after sampling is retried request by request; seeded requests (noise by seed and output
    length) still get exactly the tokens of a run without the failure."""
    model, _ = tiny_pairs["llama2"]
    batch = prompts(model.config.vocab_size, 4, seed=4)

    def run() -> list[list[int]]:
        engine = LLMEngine(model, None, EngineConfig(max_num_seqs=8))
        for i, prompt in enumerate(batch):
            engine.add_request(str(i), prompt, SamplingParams(temperature=1.0, seed=i, max_tokens=8, ignore_eos=True))
        finals = drain(engine)
        assert engine.stats().num_failed_requests == 0
        return [finals[str(i)].outputs[0].token_ids for i in range(len(batch))]

    expected = run()
    original, calls = Sampler.__call__, []

    def fails_once_after_drawing(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        calls.append(1)
        if len(calls) == 3:  # the third step: the generators have drawn, then the step fails
            raise RuntimeError("a fault after sampling")
        return out

    monkeypatch.setattr(Sampler, "__call__", fails_once_after_drawing)
    assert run() == expected
    assert len(calls) > 3


# ------------------------------------------------------------------------------------------ prefix cache
def _colliding(parent, token_ids):
    """A deliberately weak hash: only the first token of each block counts."""
    return hash((parent, token_ids[0]))


@pytest.mark.parametrize("weak_hash", [_colliding, lambda parent, token_ids: 0])
def test_colliding_block_hashes_never_reuse_another_prompts_blocks(tiny_pairs, monkeypatch, weak_hash) -> None:
    model, _ = tiny_pairs["llama2"]
    vocab = model.config.vocab_size
    rng = random.Random(4)
    first = [rng.randrange(6, vocab) for _ in range(48)]
    # Same first token in every block, different everything else: every block hash collides.
    second = [token if i % 16 == 0 else (token + 1) % vocab or 6 for i, token in enumerate(first)]
    # And a prompt whose second block collides with `first`'s after a different first block.
    third = list(second[:16]) + first[16:]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    expected = {name: generate(model, p, params) for name, p in (("first", first), ("second", second), ("third", third))}
    monkeypatch.setattr(prefix_cache_module, "block_hash", weak_hash)
    monkeypatch.setattr(block_manager_module, "block_hash", weak_hash, raising=False)
    engine = LLMEngine(model, None, EngineConfig(block_size=16, num_kv_blocks=64, enable_prefix_caching=True))
    for name, prompt in (("first", first), ("second", second), ("third", third), ("again", first)):
        engine.add_request(name, prompt, params)
        finals = drain(engine)  # one at a time: every later prompt finds the earlier ones' blocks cached
        assert finals[name].outputs[0].token_ids == expected["first" if name == "again" else name], name
    assert engine.stats().prefix_cache_hit_tokens >= 16  # the true repeat still hits


# ---------------------------------------------------------------------------------------------- second round
def test_a_seed_at_the_top_of_its_range_with_n_above_one_runs(tiny_pairs) -> None:
    """Completion i of a seeded request uses seed + i, wrapped within the 64-bit range: seed 2**63 - 1 with n = 2
    gives its second completion seed -2**63 (it used to fail its own validation inside the engine)."""
    model, _ = tiny_pairs["llama2"]
    engine = LLMEngine(model, None, EngineConfig(num_kv_blocks=64))
    params = dict(temperature=1.0, max_tokens=6, ignore_eos=True)
    engine.add_request("top", [5, 6, 7], SamplingParams(n=2, seed=2**63 - 1, **params))
    engine.add_request("wrapped", [5, 6, 7], SamplingParams(seed=-(2**63), **params))
    engine.add_request("last", [5, 6, 7], SamplingParams(seed=2**63 - 1, **params))
    finals = drain(engine)
    top = [c.token_ids for c in finals["top"].outputs]
    assert top == [finals["last"].outputs[0].token_ids, finals["wrapped"].outputs[0].token_ids]
    assert top[0] != top[1]


def test_a_request_the_scheduler_refuses_leaves_nothing_behind(tiny_pairs, monkeypatch) -> None:
    model, _ = tiny_pairs["llama2"]
    engine = LLMEngine(model, None, EngineConfig(num_kv_blocks=64))
    request = engine.input_processor.process("x", [5, 6, 7], SamplingParams(max_tokens=3))
    monkeypatch.setattr(engine.scheduler, "add", lambda *args: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        engine.add_processed(request)
    assert not engine.requests and not engine.has_unfinished_requests()


def test_drafts_never_starve_the_running_sequences(tiny_pairs) -> None:
    """A budget of 8 tokens, 4 running sequences, 4 drafts each: a step verifies drafts only once every running
    sequence has its own token (before, the first sequences took 1 + 4 drafts and 1 + 2, and the last ones
    waited, step after step, while the first ones kept drafting)."""
    model, _ = tiny_pairs["llama3"]
    engine = LLMEngine(model, None, EngineConfig(
        max_num_seqs=4, max_num_batched_tokens=8, num_kv_blocks=128, speculative_config={
            "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 2}))
    phrase = [11, 12, 13]
    for i in range(4):
        engine.add_request(str(i), phrase * 2 + [20 + i], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    scheduler, steps = engine.scheduler, []
    schedule = scheduler.schedule

    def recorded():
        batch = schedule()
        steps.append((batch, set(scheduler.running)))
        return batch

    scheduler.schedule = recorded
    drain(engine)
    with_drafts = [(batch, running) for batch, running in steps if any(item.draft_token_ids for item in batch.items)]
    assert len(with_drafts) > 5 and engine.stats().num_accepted_tokens > 0
    assert any(len(running) == 4 for _, running in with_drafts)
    for batch, running in with_drafts:
        assert {item.seq for item in batch.items} == running and batch.num_tokens <= 8


def test_a_failed_output_step_takes_every_sequence_of_the_request_out(tiny_pairs, monkeypatch) -> None:
    """The output processor fails for a request of n = 3 while its prompt is still being computed (its siblings are
    forks yet to be made): all three finish with an error and leave the scheduler; nothing runs them afterwards."""
    from llm_runtime.engine.output_processor import OutputProcessor

    model, _ = tiny_pairs["llama2"]
    engine = LLMEngine(model, None, EngineConfig(max_num_seqs=8, max_num_batched_tokens=16, num_kv_blocks=64))
    others = prompts(model.config.vocab_size, 3, seed=4)
    for i, prompt in enumerate(others):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    engine.add_request("bad", list(range(3, 43)), SamplingParams(n=3, temperature=0, max_tokens=30, ignore_eos=True))
    process = OutputProcessor._process_request

    def failing(self, state, *args):
        if state.request.request_id == "bad":
            raise RuntimeError("injected fault in the output step")
        return process(self, state, *args)

    monkeypatch.setattr(OutputProcessor, "_process_request", failing)
    finals = drain(engine)
    assert [c.finish_reason for c in finals["bad"].outputs] == ["error"] * 3
    assert engine.stats().num_failed_requests == 1 and not engine.scheduler.forks
    for i, prompt in enumerate(others):
        assert finals[str(i)].outputs[0].token_ids == generate(model, prompt, SamplingParams(
            temperature=0, max_tokens=8, ignore_eos=True))
    assert engine.stats().num_used_blocks == 0


def test_a_device_fault_kills_the_engine_instead_of_failing_every_request(tiny_pairs, monkeypatch) -> None:
    """After an illegal memory access every CUDA call fails: retrying the step one request at a time would fail
    each request in turn and leave a dead engine serving errors. The engine says it is dead instead."""
    from llm_runtime.errors import EngineDeadError

    model, _ = tiny_pairs["llama2"]
    engine = LLMEngine(model, None, EngineConfig(num_kv_blocks=64))
    for i in range(3):
        engine.add_request(str(i), [5, 6, 7 + i], SamplingParams(max_tokens=4))
    calls = []

    def faulty_run(batch):
        calls.append(batch)
        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(engine.model_runner, "run", faulty_run)
    with pytest.raises(EngineDeadError, match="illegal memory access"):
        engine.step()
    assert len(calls) == 1 and engine.stats().num_failed_requests == 0
    with pytest.raises(EngineDeadError):
        engine.add_request("late", [5], SamplingParams(max_tokens=2))
    with pytest.raises(EngineDeadError):
        engine.step()
    engine.shutdown()


def test_a_cuda_error_that_leaves_the_context_usable_is_retried_per_request(tiny_pairs, monkeypatch) -> None:
    """An invalid launch configuration is not a broken context: the step is retried one request at a time, and
    only the request that meets it again fails."""
    model, _ = tiny_pairs["llama2"]
    engine = LLMEngine(model, None, EngineConfig(num_kv_blocks=64))
    for i in range(3):
        engine.add_request(str(i), [5, 6, 7 + i], SamplingParams(temperature=0, max_tokens=4))
    run = engine.model_runner.run

    def faulty_run(batch):
        if any(item.seq.request_id == "1" for item in batch.items):
            raise torch.AcceleratorError("CUDA error: invalid configuration argument")
        return run(batch)

    monkeypatch.setattr(engine.model_runner, "run", faulty_run)
    finals = drain(engine)
    assert [finals[str(i)].outputs[0].finish_reason for i in range(3)] == ["length", "error", "length"]
    assert engine.dead_reason is None and engine.stats().num_failed_requests == 1


def test_a_chat_longer_than_any_context_is_refused_before_it_is_rendered(tiny_chat_model) -> None:
    """Each message may be short while the chat is not: the whole chat's characters count (before, each message
    was checked alone, so 1,000 messages of the limit each went to the template and the tokenizer)."""
    model, tokenizer = tiny_chat_model
    engine = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=64))
    processor = engine.input_processor
    each = processor.max_model_len * processor.max_token_chars // 3 + 1  # under the limit alone, over it as 3
    with pytest.raises(InvalidRequestError, match="messages of .* characters is longer") as refused:
        processor.process_chat("a", [{"role": "user", "content": "x" * each}] * 3)
    assert refused.value.param == "messages" and not engine.has_unfinished_requests()
    engine.shutdown()
