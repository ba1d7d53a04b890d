"""`AsyncLLMEngine`'s loop: whatever it does between steps for one request fails that request's stream alone.

A tiny random-weight model over the bundled tokenizer (milliseconds a step): these tests are about the loop.
"""

from __future__ import annotations

import asyncio

from llm_runtime import EngineConfig, LLMEngine, SamplingParams
from llm_runtime.serving.async_engine import AsyncLLMEngine


async def _final_text(stream) -> str:
    text = ""
    async for output in stream:
        text = output.outputs[0].text
    return text


def test_a_request_that_fails_to_join_ends_its_own_stream_and_the_loop_goes_on(tiny_chat_model) -> None:
    model, tokenizer = tiny_chat_model
    engine = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=64))
    add = engine.add_processed

    def failing_add(request):
        if request.request_id == "bad":
            raise RuntimeError("injected: this request cannot join")
        add(request)

    engine.add_processed = failing_add

    async def scenario():
        async_engine = AsyncLLMEngine(engine)
        await async_engine.start()
        params = SamplingParams(temperature=0, max_tokens=4)
        bad = await async_engine.add_request("Hello", params, request_id="bad")
        good = await async_engine.add_request("Hello", params, request_id="good")
        outcome = await asyncio.gather(_final_text(bad), _final_text(good), return_exceptions=True)
        later = await _final_text(await async_engine.add_request("Hello", params))
        running = async_engine.is_running
        await async_engine.stop()
        return outcome, later, running

    (bad, good), later, running = asyncio.run(asyncio.wait_for(scenario(), timeout=60))
    assert isinstance(bad, RuntimeError) and "cannot join" in str(bad)
    assert isinstance(good, str) and later == good and running


def test_a_seed_at_the_top_of_its_range_with_n_2_is_served(tiny_chat_model) -> None:
    """The second completion of seed 2**63 - 1 gets seed -2**63; before, its parameters failed validation inside
    the loop, which stopped, and every later request was refused."""
    model, tokenizer = tiny_chat_model

    async def scenario():
        async_engine = AsyncLLMEngine(LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=64)))
        await async_engine.start()
        stream = await async_engine.add_request("Hello", SamplingParams(n=2, seed=2**63 - 1, max_tokens=4))
        outputs = [output async for output in stream]
        after = await _final_text(await async_engine.add_request("Hello", SamplingParams(max_tokens=2)))
        running = async_engine.is_running
        await async_engine.stop()
        return outputs[-1], after, running

    final, after, running = asyncio.run(asyncio.wait_for(scenario(), timeout=60))
    assert final.finished and len(final.outputs) == 2 and running and isinstance(after, str)


def test_back_pressure_counts_requests_not_sequences(tiny_chat_model) -> None:
    """A queued request of n = 4 is one waiting request (max_waiting_requests counts requests); it was 4."""
    model, tokenizer = tiny_chat_model
    engine = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=64))
    engine.add_request("four", "Hello", SamplingParams(n=4, max_tokens=2))
    stats = engine.stats()
    assert stats.num_waiting == 4 and stats.num_waiting_requests == 1
    assert AsyncLLMEngine(engine, max_waiting_requests=2).num_waiting == 1
    engine.step()  # the parent runs: no request is waiting any more
    assert engine.stats().num_waiting_requests == 0


def test_a_slow_compile_holds_up_only_its_own_request(tiny_chat_model, monkeypatch) -> None:
    """A constrained request whose grammar takes long to compile waits for it on the loop: requests sent after it
    are tokenized, run and finish meanwhile (before, the compile ran on the one input thread and held up every
    request's tokenization for up to 10 s). A burst of 20 requests with another new schema compiles it once."""
    from llm_runtime.sampling import StructuredOutputsParams

    model, tokenizer = tiny_chat_model
    engine = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=256, max_num_seqs=32))
    compiler = engine.input_processor.grammar_compiler()
    real, release, runs = compiler._compile_now, __import__("threading").Event(), []

    def slow(params):
        runs.append(params.spec)
        if params.regex == "slow|words":
            release.wait(30)
        return real(params)

    monkeypatch.setattr(compiler, "_compile_now", slow)

    async def scenario():
        async_engine = AsyncLLMEngine(engine)
        await async_engine.start()
        slow_params = SamplingParams(temperature=0, max_tokens=8,
                                     structured_outputs=StructuredOutputsParams(regex="slow|words"))
        constrained = asyncio.create_task(async_engine.add_request("Hello", slow_params))
        await asyncio.sleep(0.05)
        plain = [await _final_text(await async_engine.add_request(f"Hi {i}", SamplingParams(max_tokens=3)))
                 for i in range(3)]
        waiting = not constrained.done()
        release.set()
        text = await _final_text(await constrained)
        burst_params = SamplingParams(temperature=0, max_tokens=4, structured_outputs=StructuredOutputsParams(
            choice=["alpha", "beta"]))
        burst = await asyncio.gather(*(async_engine.add_request("Pick", burst_params) for _ in range(20)))
        burst_texts = await asyncio.gather(*(_final_text(stream) for stream in burst))
        await async_engine.stop()
        return plain, waiting, text, burst_texts

    plain, waiting, text, burst_texts = asyncio.run(asyncio.wait_for(scenario(), timeout=60))
    assert waiting and len(plain) == 3 and text in ("slow", "words")
    assert set(burst_texts) <= {"alpha", "beta"} and runs.count('["alpha", "beta"]') == 1
    engine.shutdown()
