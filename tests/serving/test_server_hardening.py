"""The server against careless and hostile clients, and against third-party clients' expectations.

Each test here was written first against the server before the hardening work, and failed there.
"""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import openai
import pytest

from llm_runtime import EngineConfig, LLMEngine, SamplingParams
from llm_runtime.serving.async_engine import AsyncLLMEngine
from llm_runtime.serving.server import create_app
from servers import MODEL_NAME, TEST_KV_MEMORY, bundled_server, openai_client, running, wait_idle

MULTIBYTE_PROMPT = "日本の首都は"  # the bundled model answers in Japanese: tokens that end mid-character

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(bundled):
    with bundled_server(bundled, max_num_seqs=16, max_num_batched_tokens=512) as running_server:
        yield running_server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai_client(server[0])


def completion(base: str, **body) -> httpx.Response:
    return httpx.post(f"{base}/v1/completions", json={"model": MODEL_NAME, "max_tokens": 4, **body}, timeout=60)


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param, error
    return error


def assert_healthy(base: str, engine: LLMEngine) -> None:
    wait_idle(engine)
    assert httpx.get(f"{base}/health").status_code == 200
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


# ---------------------------------------------------------------------------------------------- input
@pytest.mark.parametrize("body, param", [
    (dict(stop_token_ids=[10**6], min_tokens=2), "stop_token_ids"),
    (dict(logprobs=21), "logprobs"),
    (dict(seed=2**64), "seed"),
    (dict(stop=["x"] * 100), "stop"),
    (dict(prompt=[[False]]), "prompt"),
    (dict(prompt=[[1, 2, 10**7]]), "prompt"),
    (dict(n=1000), "n"),
])
def test_out_of_range_requests_get_a_400_naming_the_field(server, body, param) -> None:
    base, engine, _ = server
    assert_error(completion(base, **({"prompt": "Hello"} | body)), 400, param)
    assert_healthy(base, engine)
    assert completion(base, prompt="Hello", temperature=0).status_code == 200


def test_a_refused_prompt_rolls_back_the_whole_request(server) -> None:
    base, engine, _ = server
    prompts = ["Hello"] * 5 + [[10**7]]
    assert_error(completion(base, prompt=prompts, max_tokens=200, ignore_eos=True), 400, "prompt")
    assert not engine.has_unfinished_requests()  # nothing of the refused request is left running


def test_bodies_over_the_limit_get_413(server) -> None:
    base, engine, _ = server
    assert_error(completion(base, prompt="a " * (3 * 2**20)), 413)
    assert_healthy(base, engine)


def test_tokenization_and_the_chat_template_run_off_the_event_loop(server, monkeypatch) -> None:
    base, engine, _ = server
    threads: list[str] = []
    tokenizer = engine.tokenizer
    for name in ("encode", "apply_chat_template"):
        original = getattr(tokenizer, name)

        def recording(*args, _original=original, **kwargs):
            threads.append(threading.current_thread().name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(tokenizer, name, recording)
    assert completion(base, prompt="Hello there").status_code == 200
    chat = httpx.post(f"{base}/v1/chat/completions", json={"model": MODEL_NAME, "max_tokens": 2,
                                                            "messages": [{"role": "user", "content": "Hi"}]})
    assert chat.status_code == 200
    assert threads and "uvicorn" not in threads  # the thread that runs the event loop never tokenizes


# ---------------------------------------------------------------------------------------------- output
def test_logprobs_come_back_in_openai_shapes(client) -> None:
    response = client.completions.create(model=MODEL_NAME, prompt="The capital of France is", max_tokens=5,
                                         temperature=0, logprobs=3)
    logprobs = response.choices[0].logprobs
    assert logprobs is not None and len(logprobs.tokens) == len(logprobs.token_logprobs) == 5
    assert "".join(logprobs.tokens) == response.choices[0].text
    assert all(len(top) == 3 for top in logprobs.top_logprobs)
    assert all(max(top.values()) >= lp - 1e-4 for top, lp in zip(logprobs.top_logprobs, logprobs.token_logprobs))
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob <= 0 and c.bytes is not None for c in content)


def test_one_chunk_per_generated_token_even_with_an_empty_text_delta(client) -> None:
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=MULTIBYTE_PROMPT, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    token_chunks = [c for c in chunks if c.choices]
    assert usage is not None and len(token_chunks) == usage.completion_tokens == 16
    assert any(c.choices[0].text == "" for c in token_chunks)  # a token that ended mid-character


def test_chat_content_may_be_a_list_of_text_parts(client) -> None:
    """As OpenAI's API allows; text parts are joined with newlines, as vLLM does."""
    def ask(content) -> str:
        return client.chat.completions.create(model=MODEL_NAME, max_tokens=8, temperature=0, messages=[
            {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
            {"role": "user", "content": content}]).choices[0].message.content

    assert ask([{"type": "text", "text": "What is"}, {"type": "text", "text": "2 + 2?"}]) == ask("What is\n2 + 2?")


# ---------------------------------------------------------------------------------------------- disconnects
def test_a_non_streaming_client_that_hangs_up_is_aborted(server, caplog) -> None:
    base, engine, app = server
    before = app.state.async_engine.num_aborted
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base}/v1/completions", timeout=1.0, json={
            "model": MODEL_NAME, "prompt": "Count:", "max_tokens": 2000, "ignore_eos": True})
    wait_idle(engine)  # without the abort this would run 2000 tokens for nobody
    assert app.state.async_engine.num_aborted == before + 1
    assert_healthy(base, engine)
    assert not [r for r in caplog.records if r.levelname == "ERROR"], "answering a gone client raised"


# ---------------------------------------------------------------------------------------------- faults
@pytest.fixture()
def faulty_server(bundled, monkeypatch):
    """A server whose model fails for any batch that reaches position 40 (a bug only long requests hit)."""
    model, tokenizer = bundled
    forward = type(model).forward

    def failing_forward(self, input_ids, kv_cache=None, positions=None):
        if positions is not None and bool((positions >= 40).any()):
            raise RuntimeError("injected fault")
        return forward(self, input_ids, kv_cache, positions)

    monkeypatch.setattr(model, "forward", failing_forward.__get__(model))
    # native_step=False: a native step (lesson 19) never calls the model's forward, where the fault is
    engine = LLMEngine(model, tokenizer, EngineConfig(max_num_seqs=8, kv_cache_memory=TEST_KV_MEMORY,
                                                      native_step=False))
    app = create_app(engine, MODEL_NAME)
    with running(app) as base:
        yield base, engine


def test_a_failing_request_gets_an_error_and_the_server_stays_healthy(faulty_server) -> None:
    base, engine = faulty_server
    short = completion(base, prompt="Hello", max_tokens=8, temperature=0)
    assert short.status_code == 200
    failed = completion(base, prompt="Hello", max_tokens=60, ignore_eos=True)
    assert_error(failed, 500)
    body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 60, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as response:
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])
    assert len(events) > 3  # chunks went out before the failure
    assert completion(base, prompt="Hello", max_tokens=8, temperature=0).json() ["choices"][0]["text"] == \
        short.json()["choices"][0]["text"]
    assert_healthy(base, engine)


def test_every_failure_is_an_openai_error_object(server) -> None:
    base, _, _ = server
    assert_error(httpx.get(f"{base}/v1/nowhere"), 404)
    assert_error(httpx.get(f"{base}/v1/completions"), 405)
    assert_error(httpx.post(f"{base}/v1/completions", content=b"{", headers={"content-type": "application/json"}), 400)


def test_a_dead_engine_loop_answers_503_with_an_error_object(bundled, monkeypatch) -> None:
    model, tokenizer = bundled
    engine = LLMEngine(model, tokenizer, EngineConfig(max_num_seqs=2, kv_cache_memory=TEST_KV_MEMORY))
    monkeypatch.setattr(engine.scheduler, "schedule", lambda: 1 / 0)  # a bug outside any one request
    with running(create_app(engine, MODEL_NAME)) as base:
        assert_error(completion(base, prompt="Hello"), 500)
        assert_error(httpx.get(f"{base}/health"), 503)
        assert_error(completion(base, prompt="Hello"), 503)


# ---------------------------------------------------------------------------------------------- threads
def test_request_ids_stay_unique_until_their_stream_closes(bundled) -> None:
    model, tokenizer = bundled

    async def scenario() -> list[str]:
        engine = AsyncLLMEngine(LLMEngine(model, tokenizer,
                                          EngineConfig(max_num_seqs=2, kv_cache_memory=TEST_KV_MEMORY)))
        await engine.start()
        params = SamplingParams(temperature=0, max_tokens=3)
        first = await engine.add_request("Hello", params, request_id="same")
        first.cancel()
        texts = []
        try:
            second = await engine.add_request("Hello", params, request_id="same")
        except ValueError:
            texts.append("refused")
        else:
            async for output in second:
                if output.finished:
                    texts.append(output.outputs[0].text)
        await engine.stop()
        return texts

    texts = asyncio.run(asyncio.wait_for(scenario(), timeout=60))
    assert len(texts) == 1  # refused while the first is being aborted, or served; never silently dropped


def test_handlers_never_read_the_scheduler_while_a_step_runs(bundled, monkeypatch) -> None:
    model, tokenizer = bundled
    engine = LLMEngine(model, tokenizer, EngineConfig(max_num_seqs=8, kv_cache_memory=TEST_KV_MEMORY))
    in_step = threading.Event()
    violations: list[str] = []
    step, stats = engine.step, engine.stats

    def marked_step():
        in_step.set()
        try:
            return step()
        finally:
            in_step.clear()

    def checked_stats():
        if in_step.is_set() and threading.current_thread().name == "uvicorn":
            violations.append("stats() read on the event loop during a step")
        return stats()

    monkeypatch.setattr(engine, "step", marked_step)
    monkeypatch.setattr(engine, "stats", checked_stats)
    with running(create_app(engine, MODEL_NAME)) as base:
        async def load() -> int:
            async with httpx.AsyncClient(base_url=base, timeout=60) as http:
                body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 16}
                requests = [asyncio.create_task(http.post("/v1/completions", json=body)) for _ in range(4)]
                scrapes = 0
                while not all(task.done() for task in requests):  # scrape while the steps run
                    assert (await http.get("/metrics")).status_code == 200
                    scrapes += 1
                assert all(task.result().status_code == 200 for task in requests)
                return scrapes

        assert asyncio.run(load()) > 5
    assert not violations, violations[:3]


# ---------------------------------------------------------------------------------------------- schema
def test_the_openapi_schema_tells_the_truth(server) -> None:
    base, _, _ = server
    schema = httpx.get(f"{base}/openapi.json").json()
    paths = schema["paths"]
    for path, method in (("/v1/completions", "post"), ("/v1/chat/completions", "post")):
        responses = paths[path][method]["responses"]
        assert "422" not in responses and {"400", "404", "413", "500", "503"} <= set(responses)
        content = responses["200"]["content"]
        assert content["application/json"]["schema"] and "text/event-stream" in content
        body = schema["components"]["schemas"][paths[path][method]["requestBody"]["content"]["application/json"]
                                               ["schema"]["$ref"].split("/")[-1]]["properties"]
        assert body["temperature"]["minimum"] == 0 and body["top_p"]["maximum"] == 1
        assert body["n"]["minimum"] == 1 and body["seed"]["anyOf"][0]["maximum"] == 2**63 - 1
    assert "text/plain" in paths["/metrics"]["get"]["responses"]["200"]["content"]
    for path in ("/v1/models", "/health"):
        assert paths[path]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
