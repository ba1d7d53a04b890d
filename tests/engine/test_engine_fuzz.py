"""hypothesis drives `LLMEngine` with random valid and invalid parameters, prompts and aborts.

Whatever it sends: a refusal is an `InvalidRequestError` naming a field, before anything runs; an
accepted request finishes exactly once (stop, length or abort); a greedy request that was not
aborted gets exactly its tokens when run alone; logprobs have the shapes asked for; the
scheduler's books balance after every step (the conftest's invariant check); and at the end no KV
block is in use. The model is a tiny float64 Llama over the bundled tokenizer (text, chat, stop
strings all work; batching cannot flip an argmax).
"""

from __future__ import annotations

import math
from dataclasses import fields, replace

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from llm_runtime import EngineConfig, LLMEngine, SamplingParams, generate
from llm_runtime.errors import InvalidRequestError

VOCAB = 49152
PARAM_FIELDS = {f.name for f in fields(SamplingParams)} | {"request_id", "prompt"}

numbers = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-3, 3), st.booleans())
token_ids = st.one_of(st.integers(0, VOCAB - 1), st.integers(VOCAB, VOCAB + 3), st.integers(-2, -1), st.booleans())

# Mostly valid parameters (so requests run), and some with anything at all in them.
valid_params = st.fixed_dictionaries({}, optional={
    "n": st.integers(1, 3),
    "temperature": st.sampled_from([0.0, 0.0, 0.7, 1.5]),
    "top_p": st.sampled_from([1.0, 0.9, 0.5]),
    "top_k": st.sampled_from([-1, 0, 1, 5, 100]),
    "min_p": st.sampled_from([0.0, 0.1]),
    "presence_penalty": st.sampled_from([0.0, 0.5]),
    "repetition_penalty": st.sampled_from([1.0, 1.2]),
    "seed": st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),
    "stop": st.one_of(st.none(), st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=4), max_size=3)),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=3),
    "ignore_eos": st.booleans(),
    "max_tokens": st.one_of(st.none(), st.integers(1, 12)),
    "min_tokens": st.integers(0, 3),
    "logprobs": st.one_of(st.none(), st.integers(0, 5)),
    "prompt_logprobs": st.one_of(st.none(), st.integers(0, 3)),
})
wild_params = st.fixed_dictionaries({}, optional={
    "n": st.one_of(st.integers(0, 6), st.booleans()),
    "temperature": numbers, "top_p": numbers, "min_p": numbers, "presence_penalty": numbers,
    "frequency_penalty": numbers, "repetition_penalty": numbers,
    "top_k": st.integers(-3, 60000),
    "seed": st.one_of(st.none(), st.integers(-(2**63) - 2, 2**64 + 2)),
    "stop": st.one_of(st.none(), st.text(max_size=3), st.lists(st.text(max_size=300), max_size=20)),
    "stop_token_ids": st.one_of(st.none(), st.lists(token_ids, max_size=3)),
    "ignore_eos": st.one_of(st.booleans(), st.integers(0, 1)),
    "max_tokens": st.one_of(st.none(), st.integers(-1, 12), st.sampled_from([10**6])),
    "min_tokens": st.integers(-1, 6),
    "logprobs": st.one_of(st.none(), st.integers(-1, 25)),
    "prompt_logprobs": st.one_of(st.none(), st.integers(-1, 25)),
})
params_strategy = st.one_of(valid_params, valid_params, valid_params, wild_params)
prompt_strategy = st.one_of(
    st.text(max_size=40),
    st.text(min_size=1, max_size=40),
    st.lists(token_ids, max_size=30),
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=90),
    st.builds(lambda ids: {"prompt_token_ids": ids}, st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20)),
    st.builds(lambda text: {"prompt": text}, st.text(min_size=1, max_size=20)),
    st.sampled_from([None, 3, b"bytes", {"wrong": 1}, {"prompt": 1}]),
)
# Per request: its prompt, its parameters, and after how many steps it is aborted (None: never).
requests_strategy = st.lists(st.tuples(prompt_strategy, params_strategy, st.one_of(st.none(), st.integers(0, 8))),
                             min_size=1, max_size=8)


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_chat_model):
    return tiny_chat_model


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(requests=requests_strategy, block_size=st.sampled_from([4, 16]), num_kv_blocks=st.integers(12, 60),
       chunked=st.booleans())
def test_random_requests_and_aborts_never_break_the_engine(model_and_tokenizer, requests, block_size, num_kv_blocks,
                                                           chunked) -> None:
    model, tokenizer = model_and_tokenizer
    engine = LLMEngine(model, tokenizer, EngineConfig(
        max_num_seqs=4, max_num_batched_tokens=48, block_size=block_size, num_kv_blocks=num_kv_blocks,
        enable_chunked_prefill=chunked))
    accepted: dict[str, tuple[SamplingParams, int | None]] = {}
    for i, (prompt, raw_params, abort_after) in enumerate(requests):
        try:
            params = SamplingParams(**raw_params)
            engine.add_request(str(i), prompt, params)
        except InvalidRequestError as error:
            assert error.param in PARAM_FIELDS, error
            continue
        except ValueError as error:
            raise AssertionError(f"a refusal must name its field: {error!r}") from error
        accepted[str(i)] = (params, abort_after)
    event(f"accepted {len(accepted)} of {len(requests)}")

    finals = {}
    step = 0
    while engine.has_unfinished_requests():
        for request_id, (_, abort_after) in accepted.items():
            if abort_after == step and request_id in engine.requests:
                engine.abort_request(request_id)
        for output in engine.step():
            if output.finished:
                assert output.request_id not in finals, "a request finished twice"
                finals[output.request_id] = output
        step += 1
        assert step < 2000, "the engine is stuck"

    stats = engine.stats()
    assert stats.num_used_blocks == 0 and stats.num_running == stats.num_waiting == 0
    for request_id, (params, abort_after) in accepted.items():
        if request_id not in finals:  # aborted: an aborted request gets no more output
            assert abort_after is not None
            continue
        output = finals[request_id]
        assert len(output.outputs) == params.n
        for completion in output.outputs:
            assert completion.finish_reason in ("stop", "length")
            if params.logprobs is not None:
                assert len(completion.logprobs) == len(completion.token_ids)
                assert all(token in entry and len(entry) <= params.logprobs + 1
                           for token, entry in zip(completion.token_ids, completion.logprobs))
        if params.prompt_logprobs is not None:
            assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(output.prompt_token_ids)
            assert all(math.isfinite(entry[token]) for token, entry in
                       zip(output.prompt_token_ids[1:], output.prompt_logprobs[1:]))
        if params.is_greedy and not params.has_penalties and not params.stop:
            alone = generate(model, output.prompt_token_ids, replace(params, n=1, max_tokens=engine.max_model_len
                                                                     - len(output.prompt_token_ids)
                                                                     if params.max_tokens is None else params.max_tokens))
            assert all(completion.token_ids == alone for completion in output.outputs), request_id
