"""Who may do what on a server (serving/server.py, middleware.py), over a tiny random-weight model: with an API key
every `/v1` route wants it as a bearer token (401 in OpenAI's error shape without it; `/health` and `/metrics`
open; the live feed also takes it as `?api_key=`, which the dashboard passes on); `POST /reset_prefix_cache`
exists only with `enable_dev_routes` (and wants the key when there is one); and a failure while building the live
feed's events ends the live views, never the engine's loop."""

from __future__ import annotations

import json

import httpx
import pytest

from llm_runtime import EngineConfig, LLMEngine
from llm_runtime.serving.server import create_app
from servers import running, wait_idle

KEY = "a-key-only-the-clients-know"


@pytest.fixture
def engine(tiny_chat_model):
    model, tokenizer = tiny_chat_model
    made = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=64))
    yield made
    made.shutdown()


def _complete(base: str, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{base}/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, headers=headers,
                      timeout=30)


def _first_event(url: str) -> dict | int:
    with httpx.stream("GET", url, timeout=30) as response:
        if response.status_code != 200:
            return response.status_code
        for line in response.iter_lines():
            if line.startswith("data: "):
                return json.loads(line[6:])
    raise AssertionError("no event")


def test_with_an_api_key_every_v1_route_wants_it(engine) -> None:
    with running(create_app(engine, "tiny", api_key=KEY, enable_dev_routes=True)) as base:
        for response in (_complete(base), httpx.get(f"{base}/v1/models"),
                         _complete(base, {"Authorization": "Bearer wrong"}),
                         httpx.post(f"{base}/reset_prefix_cache")):
            assert response.status_code == 401, response.text
            assert response.json()["error"]["code"] == "invalid_api_key"
        good = {"Authorization": f"Bearer {KEY}"}
        assert _complete(base, good).status_code == 200
        assert httpx.get(f"{base}/v1/models", headers=good).status_code == 200
        assert httpx.post(f"{base}/reset_prefix_cache", headers=good).status_code == 200
        assert httpx.get(f"{base}/health").status_code == 200 and httpx.get(f"{base}/metrics").status_code == 200
        assert _first_event(f"{base}/v1/engine/events") == 401
        assert _first_event(f"{base}/v1/engine/events?api_key=wrong") == 401
        assert _first_event(f"{base}/v1/engine/events?api_key={KEY}")["type"] == "hello"
    with running(create_app(engine, "tiny")) as base:  # no key configured: as before
        assert _complete(base).status_code == 200


def test_the_prefix_cache_reset_is_a_development_route(engine) -> None:
    with running(create_app(engine, "tiny")) as base:
        assert httpx.post(f"{base}/reset_prefix_cache").status_code == 404
        assert "/reset_prefix_cache" not in httpx.get(f"{base}/openapi.json").json()["paths"]
    with running(create_app(engine, "tiny", enable_dev_routes=True)) as base:
        assert httpx.post(f"{base}/reset_prefix_cache").json() == {"freed_blocks": 0}


def test_a_failure_building_the_feed_ends_the_views_not_the_loop(engine, monkeypatch) -> None:
    app = create_app(engine, "tiny")
    feed = app.state.async_engine.feed

    def broken(now):
        raise RuntimeError("injected fault in the live feed")

    monkeypatch.setattr(feed, "state", broken)
    with running(app) as base:
        with httpx.stream("GET", f"{base}/v1/engine/events", timeout=30) as response:
            lines = [line for line in response.iter_lines() if line.startswith("event: ")]
        assert lines == ["event: hello"]  # then the stream ended: its first state could not be built
        assert _complete(base).status_code == 200 and httpx.get(f"{base}/health").status_code == 200
        assert feed.num_failures >= 1 and not feed.subscribers
        wait_idle(engine)


def test_a_key_in_the_query_in_any_bytes_is_refused_not_a_500(engine) -> None:
    with running(create_app(engine, "tiny", api_key=KEY)) as base:
        for query in ("api_key=%E2%82%AC", "api_key=%FF%FE", "api_key=", "api_key=a&api_key=" + KEY):
            assert _first_event(f"{base}/v1/engine/events?{query}") == 401, query


def test_the_access_log_shows_no_key() -> None:
    import logging

    from llm_runtime.serving.middleware import RedactApiKey

    record = logging.LogRecord("uvicorn.access", logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d',
                               ("127.0.0.1:5", "GET", f"/v1/engine/events?api_key={KEY}&x=1", "1.1", 200), None)
    RedactApiKey().filter(record)
    assert KEY not in record.getMessage() and "api_key=...&x=1" in record.getMessage()
