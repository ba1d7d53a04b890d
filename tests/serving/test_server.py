"""The OpenAI-compatible server, started for real on a loopback port and spoken to with the `openai` client."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import openai
import pytest

from llm_runtime import LLM, EngineConfig, LLMEngine, SamplingParams, encode_chat
from llm_runtime.serving.async_engine import AsyncLLMEngine, EngineBusyError
from servers import MODEL_NAME, TEST_KV_MEMORY, bundled_server, openai_client, wait_idle

PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time", "The three primary colors are",
           "Water boils at", "A haiku about the sea:", "1, 2, 3, 4,", "The best way to learn is"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(bundled):
    with bundled_server(bundled, {"enable_dev_routes": True}, max_num_seqs=32,
                        max_num_batched_tokens=512) as running_server:
        yield running_server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai_client(server[0])


@pytest.fixture(scope="module")
def reference(bundled) -> dict[str, str]:
    """What LLM.generate answers, greedy, 12 tokens."""
    model, tokenizer = bundled
    with LLM.from_model(model, tokenizer, kv_cache_memory=TEST_KV_MEMORY) as llm:
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    return {o.prompt: o.outputs[0].text for o in outputs}


def test_models_health_and_metrics(server, client) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert httpx.get(f"{server[0]}/health").json() == {"status": "ok"}
    text = httpx.get(f"{server[0]}/metrics").text
    for name in ("llm_runtime_num_requests_running", "llm_runtime_kv_blocks_used", "llm_runtime_prefix_cache_hit_rate",
                 "llm_runtime_time_to_first_token_seconds_bucket", "llm_runtime_inter_token_latency_seconds_count"):
        assert name in text


def test_reset_prefix_cache_makes_the_next_prompt_miss(server) -> None:
    base = server[0]
    body = {"model": MODEL_NAME, "prompt": "A long shared preamble. " * 12 + "The end.", "max_tokens": 1}

    def hits() -> float:
        lines = httpx.get(f"{base}/metrics").text.splitlines()
        return next(float(line.split()[1]) for line in lines if line.startswith("llm_runtime_prefix_cache_hits_total"))

    for _ in range(2):
        assert httpx.post(f"{base}/v1/completions", json=body).status_code == 200
    before = hits()
    assert before > 0  # the second request found the first one's blocks
    reset = httpx.post(f"{base}/reset_prefix_cache")
    assert reset.status_code == 200 and reset.json()["freed_blocks"] > 0
    assert httpx.post(f"{base}/v1/completions", json=body).status_code == 200
    assert hits() == before  # nothing left to find


def test_completions_equal_llm_generate(client, reference) -> None:
    for prompt in PROMPTS[:4]:
        response = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0)
        choice = response.choices[0]
        assert choice.text == reference[prompt] and choice.finish_reason in ("length", "stop")
        assert response.usage.completion_tokens <= 12 and response.usage.prompt_tokens > 0
    batch = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[:3], max_tokens=12, temperature=0)
    assert [c.text for c in batch.choices] == [reference[p] for p in PROMPTS[:3]]


def test_streaming_joins_to_the_same_text(client, reference) -> None:
    stream = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reference[PROMPTS[0]]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_chat_streaming_and_not(bundled, client) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    full = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=16, temperature=0)
    content = full.choices[0].message.content
    assert full.choices[0].message.role == "assistant" and "Paris" in content
    model, tokenizer = bundled
    with LLM.from_model(model, tokenizer, kv_cache_memory=TEST_KV_MEMORY) as llm:
        expected = llm.generate([{"prompt_token_ids": encode_chat(tokenizer, messages)}],
                                SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0].outputs[0].text
    assert content == expected
    parts = list(client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=16, temperature=0,
                                                stream=True))
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts) == content
    assert parts[-1].choices[0].finish_reason in ("stop", "length")


def test_sampling_fields_map_across(client) -> None:
    a = client.completions.create(model=MODEL_NAME, prompt="Tell me a story", max_tokens=10, n=2, seed=5,
                                  temperature=1.0, top_p=0.9)
    b = client.completions.create(model=MODEL_NAME, prompt="Tell me a story", max_tokens=10, n=2, seed=5,
                                  temperature=1.0, top_p=0.9)
    assert [c.index for c in a.choices] == [0, 1] and [c.text for c in a.choices] == [c.text for c in b.choices]
    stopped = client.completions.create(model=MODEL_NAME, prompt="1, 2, 3, 4,", max_tokens=20, temperature=0,
                                        stop=[","])
    assert "," not in stopped.choices[0].text and stopped.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("kwargs,status,word", [
    (dict(temperature=-1), 400, "temperature"),
    (dict(top_p=1.5), 400, "top_p"),
    (dict(n=0), 400, "n"),
    (dict(max_tokens=100_000), 400, "max_tokens"),
    (dict(model="gpt-4"), 404, "gpt-4"),
    (dict(extra_body={"max_tokens": "many"}), 400, "max_tokens"),
    (dict(extra_body={"frobnicate": 1}), 400, "frobnicate"),
])
def test_invalid_parameters_are_refused_and_the_server_keeps_serving(client, reference, kwargs, status, word) -> None:
    arguments = dict(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=12, temperature=0) | kwargs
    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(**arguments)
    assert caught.value.status_code == status and word in caught.value.message
    assert client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=12,
                                     temperature=0).choices[0].text == reference[PROMPTS[1]]


def test_malformed_bodies_get_openai_errors(server) -> None:
    url = f"{server[0]}/v1/completions"
    bad_json = httpx.post(url, content=b'{"prompt": "hi", ', headers={"Content-Type": "application/json"})
    assert bad_json.status_code == 400 and "JSON" in bad_json.json()["error"]["message"]
    missing = httpx.post(url, json={"model": MODEL_NAME})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "prompt"
    chat = httpx.post(f"{server[0]}/v1/chat/completions", json={"model": MODEL_NAME, "messages": []})
    assert chat.status_code == 400 and "messages" in chat.json()["error"]["message"]


def test_64_concurrent_streams_and_disconnects_leave_every_block_free(server, reference) -> None:
    base, engine, _ = server

    async def stream_one(client: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0,
                                                 stream=True)
        return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    async def drop_after_first_chunk(prompt: str) -> None:
        async with httpx.AsyncClient(timeout=60) as http:
            body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 200, "temperature": 0, "stream": True,
                    "ignore_eos": True}
            async with http.stream("POST", f"{base}/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        json.loads(line.removeprefix("data: "))
                        break  # leave: the connection closes with the request half done

    async def load() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(64)]
        texts = await asyncio.gather(*(stream_one(client, p) for p in prompts),
                                     *(drop_after_first_chunk(p) for p in PROMPTS))
        await client.close()
        return list(zip(prompts, texts[:64]))

    results = asyncio.run(load())
    assert all(text == reference[prompt] for prompt, text in results)
    wait_idle(engine)
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks  # the dropped ones were aborted, nothing leaked
    assert server[2].state.async_engine.num_aborted >= len(PROMPTS)  # every dropped stream was aborted
    assert httpx.get(f"{base}/health").status_code == 200


def test_a_full_queue_answers_busy(bundled) -> None:
    model, tokenizer = bundled

    async def scenario() -> tuple[int, int]:
        config = EngineConfig(max_num_seqs=1, kv_cache_memory=TEST_KV_MEMORY)
        engine = AsyncLLMEngine(LLMEngine(model, tokenizer, config), max_waiting_requests=2)
        await engine.start()
        params = SamplingParams(temperature=0, max_tokens=4)
        accepted, busy = [], 0
        for _ in range(6):
            try:
                accepted.append(await engine.add_request(PROMPTS[0], params))
            except EngineBusyError:
                busy += 1
        for stream in accepted:
            async for _ in stream:
                pass
        stats = engine.engine.stats()
        await engine.stop()
        assert stats.num_free_blocks == stats.num_total_blocks
        return len(accepted), busy

    accepted, busy = asyncio.run(scenario())
    assert accepted == 2 and busy == 4


def test_steps_run_on_the_executor_that_built_the_engine(bundled) -> None:
    """`serve` builds the engine on `step_thread()` and steps there: PyTorch's CPU work stays on one thread."""
    from llm_runtime.serving.async_engine import step_thread

    model, tokenizer = bundled
    executor = step_thread()
    builder = executor.submit(lambda: threading.get_ident()).result()
    engine = executor.submit(lambda: LLMEngine(model, tokenizer, EngineConfig(kv_cache_memory=TEST_KV_MEMORY))).result()
    stepped_on: set[int] = set()
    step = engine.step

    def recording_step():
        stepped_on.add(threading.get_ident())
        return step()

    engine.step = recording_step

    async def scenario() -> None:
        async_engine = AsyncLLMEngine(engine, step_executor=executor)
        await async_engine.start()
        stream = await async_engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=3))
        async for _ in stream:
            pass
        await async_engine.shutdown()

    asyncio.run(scenario())
    assert stepped_on == {builder}
