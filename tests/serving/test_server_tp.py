"""The server over a tensor-parallel engine (lesson 17): the bundled model at 3 ranks answers the `openai` client as
one rank does (greedy, float32), and a killed worker turns into errors and a 503 within 30 s, never a hang."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from llm_runtime import EngineConfig, LLMEngine
from llm_runtime.serving.server import create_app
from servers import MODEL_NAME, TEST_KV_MEMORY, engine_events, openai_client, running

pytestmark = pytest.mark.slow

MESSAGES = [[{"role": "user", "content": "What is the capital of France?"}],
            [{"role": "user", "content": "Name three colors."}]]


def _answers(engine: LLMEngine) -> list[str]:
    with running(create_app(engine, MODEL_NAME)) as base:
        client = openai_client(base)
        answers = [client.chat.completions.create(model=MODEL_NAME, messages=m, temperature=0, max_tokens=20,
                                                  seed=0).choices[0].message.content for m in MESSAGES]
        hello, state = engine_events(base)  # the live view of the engine, whatever its ranks
        assert hello["tensor_parallel_size"] == engine.config.tensor_parallel_size
        assert state["counters"]["steps"] > 0 and len(state["kv"]["states"]) == hello["num_blocks"]
        return answers


def test_three_ranks_answer_as_one_and_a_dead_worker_gives_503(bundled) -> None:
    model, tokenizer = bundled
    one = LLMEngine(model, tokenizer, EngineConfig(kv_cache_memory=TEST_KV_MEMORY))
    try:
        expected = _answers(one)
    finally:
        one.shutdown()
    engine = LLMEngine.from_pretrained(None, dtype="float32", config=EngineConfig(kv_cache_memory=TEST_KV_MEMORY,
                                                                                  tensor_parallel_size=3))
    try:
        assert _answers(engine) == expected
        with running(create_app(engine, MODEL_NAME)) as base:
            os.kill(engine.workers.processes[0].pid, signal.SIGKILL)
            started = time.monotonic()
            response = httpx.post(f"{base}/v1/completions", json={"model": MODEL_NAME, "prompt": "Hello",
                                                                  "max_tokens": 8}, timeout=60)
            assert response.status_code in (500, 503) and "error" in response.json()
            assert httpx.get(f"{base}/health").status_code == 503
            again = httpx.post(f"{base}/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi"}, timeout=60)
            assert again.status_code == 503 and "error" in again.json()
            assert time.monotonic() - started < 30
    finally:
        engine.shutdown()
    assert not [p for p in engine.workers.processes if p.is_alive()]
