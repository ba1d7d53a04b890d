"""Start an app under uvicorn on a free loopback port, in a thread, for as long as a test needs it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from llm_runtime.distributed.launch import free_port

MODEL_NAME = "SmolLM2-135M-Instruct"
# Test modules keep a server alive while they build other engines: each gets an explicit KV budget
# (128 MiB: 2,900 tokens of the bundled model in float32), as a notebook keeping two engines would.
TEST_KV_MEMORY = 128 << 20


@contextmanager
def bundled_server(bundled, app_options: dict | None = None, **engine_options) -> Iterator[tuple[str, object, object]]:
    """(base URL, engine, app) of a server over the bundled model, for a test module's lifetime (`app_options`: for
    create_app)."""
    from llm_runtime import EngineConfig, LLMEngine
    from llm_runtime.serving.server import create_app

    model, tokenizer = bundled
    engine = LLMEngine(model, tokenizer, EngineConfig(**{"kv_cache_memory": TEST_KV_MEMORY, **engine_options}))
    app = create_app(engine, MODEL_NAME, **(app_options or {}))
    try:
        with running(app) as base:
            yield base, engine, app
    finally:
        engine.shutdown()


def engine_events(base: str, count: int = 2) -> list[dict]:
    """The first `count` events of the server's live feed (`/v1/engine/events`): the hello, then states."""
    import json

    import httpx

    events: list[dict] = []
    with httpx.Client(timeout=30) as http, http.stream("GET", f"{base}/v1/engine/events") as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: "):]))
                if len(events) == count:
                    return events
    raise AssertionError(f"the event stream ended after {len(events)} events")


def openai_client(base: str):
    import openai

    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


@contextmanager
def running(app) -> Iterator[str]:
    """Serve `app` on 127.0.0.1; yields its base URL; stops the server (and the engine loop) on exit."""
    port = free_port()
    # An open event stream (/v1/engine/events) never ends by itself: uvicorn cancels it 3 s into the shutdown.
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=3))
    thread = threading.Thread(target=server.run, daemon=True, name="uvicorn")
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        assert time.time() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        assert not thread.is_alive(), "the server did not stop"


def wait_idle(engine, timeout: float = 30) -> None:
    """Until the engine has no request left (aborts are applied between steps)."""
    deadline = time.time() + timeout
    while engine.has_unfinished_requests() or engine.scheduler.has_unfinished():
        assert time.time() < deadline, "requests still running"
        time.sleep(0.05)
