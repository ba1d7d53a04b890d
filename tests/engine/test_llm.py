"""LLM, the vLLM-shaped offline API, on the bundled model: equal to transformers, ordered, streamable."""

from __future__ import annotations

import pytest

from conftest import transformers_greedy
from llm_runtime import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "To make a cup of tea, first",
    "Water boils at",
    "The largest planet in the solar system",
    "A haiku about autumn:",
    "1, 2, 3, 4,",
]


@pytest.fixture(scope="module")
def llm(bundled) -> LLM:
    model, tokenizer = bundled
    return LLM.from_model(model, tokenizer, max_num_seqs=8, max_num_batched_tokens=64)


@pytest.mark.slow
def test_generate_equals_transformers_generate(llm: LLM, bundled_reference) -> None:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.prompt for o in outputs] == PROMPTS  # input order
    for output in outputs:
        completion = output.outputs[0]
        expected = transformers_greedy(bundled_reference, output.prompt_token_ids, 24)
        assert completion.token_ids == expected, output.prompt
        assert completion.text == llm.tokenizer.decode(expected, skip_special_tokens=True)
        assert completion.finish_reason == "length" and output.finished
        metrics = output.metrics
        assert metrics.arrival_time <= metrics.first_scheduled_time <= metrics.first_token_time
        assert metrics.first_token_time <= metrics.finished_time and len(metrics.token_times) == 24


@pytest.mark.slow
def test_chat_stop_strings_and_per_prompt_params(llm: LLM) -> None:
    question = [{"role": "user", "content": "What is the capital of France?"}]
    answer = llm.chat(question, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0].outputs[0]
    assert answer.text == "The capital of France is Paris." and answer.finish_reason == "stop"
    params = [SamplingParams(temperature=0, stop=["Paris"]),
              SamplingParams(temperature=0, stop=" is Par", include_stop_str_in_output=True)]
    cut = llm.chat([question, question], params, use_tqdm=False)
    assert cut[0].outputs[0].text == "The capital of France is " and cut[0].outputs[0].stop_reason == "Paris"
    assert cut[1].outputs[0].text == "The capital of France is Par"


@pytest.mark.slow
def test_stream_deltas_join_to_the_final_text(llm: LLM) -> None:
    prompts = ["Write three emoji and a Chinese greeting:", "List the days of the week:", "Hi"]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=30, stop=["Friday"]) for i in range(3)]
    joined = ["", "", ""]
    finals = {}
    for index, output in llm.generate_stream(prompts, params):
        joined[index] += output.outputs[0].text_delta
        if output.finished:
            finals[index] = output.outputs[0].text
    assert set(finals) == {0, 1, 2}
    assert joined == [finals[0], finals[1], finals[2]]
    # And the same seeds give the same texts without streaming.
    assert [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)] == joined


@pytest.mark.slow
def test_stopping_a_stream_early_aborts_its_requests(llm: LLM) -> None:
    stream = llm.generate_stream(["Count to fifty:", "Name ten animals:"], SamplingParams(max_tokens=40))
    next(stream)
    stream.close()
    assert not llm.llm_engine.has_unfinished_requests() and not llm.llm_engine.scheduler.running


@pytest.mark.slow
def test_bad_prompt_in_a_batch_leaves_nothing_running(llm: LLM) -> None:
    with pytest.raises(ValueError, match="empty"):
        llm.generate(["fine", "", "also fine"], SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match="SamplingParams for 2 prompts"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    single = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(single) == 1 and len(single[0].outputs[0].token_ids) == 3


def test_a_request_that_fails_to_join_the_engine_takes_its_batch_back(tiny_chat_model, monkeypatch) -> None:
    """One refused prompt adds nothing, even when the refusal comes from the engine after the input processor
    passed every prompt: the prompts added before it are taken out again."""
    model, tokenizer = tiny_chat_model
    llm = LLM.from_model(model, tokenizer, num_kv_blocks=64)
    engine = llm.llm_engine
    add, added = engine.add_processed, []

    def add_two_then_fail(request):
        if len(added) == 2:
            raise RuntimeError("injected: the third request cannot join")
        added.append(request.request_id)
        add(request)

    monkeypatch.setattr(engine, "add_processed", add_two_then_fail)
    with pytest.raises(RuntimeError, match="third request"):
        llm.generate(["a", "b", "c", "d"], SamplingParams(max_tokens=3), use_tqdm=False)
    assert len(added) == 2 and not engine.has_unfinished_requests() and not engine.scheduler.has_unfinished()
    monkeypatch.undo()
    assert len(llm.generate(["a"], SamplingParams(max_tokens=3), use_tqdm=False)) == 1
