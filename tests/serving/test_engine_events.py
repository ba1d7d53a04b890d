"""The engine's live feed (engine_events.py, `GET /v1/engine/events`): every event fits its schema and tells the
truth about the engine; queues are bounded; a subscriber that stops reading is dropped and never slows the engine.

A tiny random-weight model over the bundled tokenizer (milliseconds a step): these tests are about the feed.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections import Counter

import httpx
import pytest

from llm_runtime import EngineConfig, LLMEngine, SamplingParams
from llm_runtime.serving import event_protocol
from llm_runtime.serving.engine_events import BLOCK_STATES, EngineFeed
from llm_runtime.serving.server import create_app
from servers import running

PREFIX = list(range(1000, 1040))  # 40 tokens: 2 full blocks of 16 that later prompts share


def _drive(engine: LLMEngine, feed: EngineFeed, requests: list[tuple[str, list[int], int]]) -> dict[str, list[int]]:
    """Run `requests` (id, prompt, max_tokens) to the end, observing as the async engine's loop does; their tokens."""
    for request_id, prompt, max_tokens in requests:
        engine.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    feed.observe()
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        outputs = engine.step()
        for output in outputs:
            if output.finished:
                tokens[output.request_id] = output.outputs[0].token_ids
        feed.observe(outputs, stepped=True)
    feed.observe()
    return tokens


def _events(subscription) -> list[dict]:
    events = list(subscription._events)
    subscription._events.clear()
    return events


def _requests(num: int, max_tokens: int = 12) -> list[tuple[str, list[int], int]]:
    return [(f"r{i}", PREFIX + [2000 + i] * (3 + i % 4), max_tokens) for i in range(num)]


def test_every_event_fits_the_schema_and_adds_up_to_what_the_engine_did(tiny_chat_model) -> None:
    model, tokenizer = tiny_chat_model
    engine = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=12, max_num_seqs=6, max_num_batched_tokens=64))
    feed = EngineFeed(engine, "tiny", interval_s=0)  # a state after every step
    subscription = feed.subscribe()
    requests = _requests(10)
    _drive(engine, feed, requests)
    events = _events(subscription)

    hello, states = events[0], events[1:]
    event_protocol.EngineEvent.model_validate({"event": hello})
    assert hello["type"] == "hello" and hello["num_blocks"] == 12 and hello["block_states"] == BLOCK_STATES
    for event in states:
        event_protocol.EngineEvent.model_validate({"event": event})
        json.dumps(event)  # what the server sends
        assert len(event["kv"]["states"]) == 12
    assert [e["event"] for e in states] == list(range(len(states)))

    steps = [step for e in states for step in e["steps"]]
    assert [s["step"] for s in steps] == list(range(engine.profile.num_steps)), "every step is reported once"
    computed = Counter()
    for step in steps:
        assert sum(item[2] + item[3] for item in step["items"]) <= 64  # the token budget
        for request_id, _, prefill, decode, proposed, kept in step["items"]:
            computed[request_id] += prefill + decode
            assert proposed == kept == 0
    finished = {f["id"]: f for e in states for f in e["finished"]}
    assert set(finished) == {request_id for request_id, _, _ in requests}
    assert all(f["reason"] == "length" and f["output_tokens"] == 12 and f["ttft_ms"] > 0 and f["itl_ms"] > 0
               for f in finished.values())
    stats = engine.stats()
    preempted = [p for step in steps for p in step["preempted"]]
    assert len(preempted) == stats.num_preemptions > 0, "the pool is small enough to preempt"
    assert any(s["preempted"] for e in states for s in e["waiting"]), "a preempted sequence shows as such"
    for request_id, prompt, max_tokens in requests:  # each computed its prompt (less prefix hits) and outputs
        assert computed[request_id] <= len(prompt) + max_tokens - 1 + 12 * (request_id in {p[0] for p in preempted})
    # Prefix sharing: while several ran, the shared prefix's blocks were marked shared and held by each.
    assert any(e["kv"]["states"].count(BLOCK_STATES["shared"]) >= 2 for e in states)
    last = states[-1]
    assert not last["running"] and not last["waiting"]
    assert last["kv"]["states"].count(".") + last["kv"]["states"].count("c") == stats.num_free_blocks == 12
    assert last["kv"]["states"].count("c") == stats.num_cached_blocks > 0
    assert last["counters"]["preemptions"] == stats.num_preemptions


def test_running_sequences_carry_their_block_tables(tiny_chat_model) -> None:
    model, tokenizer = tiny_chat_model
    engine = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=64))
    feed = EngineFeed(engine, interval_s=0)
    subscription = feed.subscribe()
    for request_id, prompt, max_tokens in _requests(3, max_tokens=30):
        engine.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    for _ in range(3):
        feed.observe(engine.step(), stepped=True)
    state = _events(subscription)[-1]
    tables = engine.block_manager.block_tables
    assert {(s["id"], tuple(s["blocks"])) for s in state["running"]} == {
        (seq.request_id, tuple(table)) for seq, table in tables.items()}
    held = Counter(block for s in state["running"] for block in s["blocks"])
    for block, count in held.items():
        assert state["kv"]["states"][block] == (BLOCK_STATES["shared"] if count > 1 else BLOCK_STATES["used"])


def test_speculative_steps_report_drafts_verified_and_kept(tiny_chat_model) -> None:
    model, tokenizer = tiny_chat_model
    engine = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=64, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}))
    feed = EngineFeed(engine, interval_s=0)
    subscription = feed.subscribe()
    _drive(engine, feed, [("a", [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6], 24)])
    events = _events(subscription)
    assert events[0]["speculative"] == {"method": "ngram", "num_speculative_tokens": 3}
    items = [item for e in events[1:] for step in e["steps"] for item in step["items"]]
    stats = engine.stats()
    assert sum(item[4] for item in items) == stats.num_draft_tokens > 0
    assert sum(item[5] for item in items) == stats.num_accepted_tokens
    assert all(0 <= item[5] <= item[4] for item in items)


def test_without_subscribers_the_feed_builds_nothing(tiny_chat_model, monkeypatch) -> None:
    model, tokenizer = tiny_chat_model
    engine = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=64))
    feed = EngineFeed(engine, interval_s=0)
    monkeypatch.setattr(feed, "state", lambda now: pytest.fail("a state was built with nobody listening"))
    _drive(engine, feed, _requests(2))
    assert feed.num_events == 0


def test_a_subscriber_that_stops_reading_is_dropped_and_the_others_go_on(tiny_chat_model) -> None:
    model, tokenizer = tiny_chat_model
    engine = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=64, max_num_seqs=2))
    feed = EngineFeed(engine, interval_s=0, max_queued=4)
    stuck, reader = feed.subscribe(), feed.subscribe()
    received = []
    for request_id, prompt, max_tokens in _requests(3):
        engine.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    while engine.has_unfinished_requests():
        feed.observe(engine.step(), stepped=True)
        received += _events(reader)
        assert stuck.num_queued <= 4, "a queue never grows past its bound"
    assert stuck.dropped and stuck.closed and feed.subscribers == [reader] and feed.num_dropped == 1
    assert not reader.dropped and len(received) == feed.num_events + 1  # the hello, then every state

    async def iterate(subscription):
        return [event async for event in subscription]

    assert asyncio.run(iterate(stuck)) == []  # its stream ends
    feed.unsubscribe(reader)
    assert feed.subscribers == []


def test_the_feed_holds_at_most_max_subscribers_even_when_views_race_past_the_servers_check(tiny_chat_model) -> None:
    model, tokenizer = tiny_chat_model
    feed = EngineFeed(LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=16)), max_subscribers=2)
    first, second, third = feed.subscribe(), feed.subscribe(), feed.subscribe()
    assert feed.subscribers == [first, second] and third.closed and third.num_queued == 0  # its stream ends at once
    feed.unsubscribe(first)
    assert not feed.subscribe().closed and len(feed.subscribers) == 2  # a freed place is taken again


def test_states_are_batched_by_time_not_by_step(tiny_chat_model) -> None:
    model, tokenizer = tiny_chat_model
    engine = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=64))
    feed = EngineFeed(engine, interval_s=3600)  # one state at subscription, one when the engine goes idle
    subscription = feed.subscribe()
    feed.observe()
    _drive(engine, feed, _requests(2))
    states = _events(subscription)[1:]
    assert len(states) == 2 and not states[0]["steps"]
    assert [s["step"] for s in states[1]["steps"]] == list(range(engine.profile.num_steps))


# ------------------------------------------------------------------------------------------ over HTTP
def test_the_endpoint_streams_a_hello_then_states_while_requests_run_and_end(tiny_chat_model) -> None:
    model, tokenizer = tiny_chat_model
    engine = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=64, max_num_seqs=4))
    with running(create_app(engine, "tiny")) as base:
        with httpx.Client(timeout=30) as http, http.stream("GET", f"{base}/v1/engine/events") as stream:
            assert stream.headers["content-type"].startswith("text/event-stream")
            lines = stream.iter_lines()

            def next_event() -> dict:
                return next(json.loads(line[len("data: "):]) for line in lines if line.startswith("data: "))

            events = [next_event(), next_event()]  # the hello, and the state at subscription
            body = {"model": "tiny", "prompt": "Hello there", "max_tokens": 8, "ignore_eos": True, "n": 2}
            assert httpx.post(f"{base}/v1/completions", json=body, timeout=30).status_code == 200
            while not any(e["finished"] for e in events[1:]):
                events.append(next_event())
            streamed = {**body, "stream": True, "max_tokens": 6}  # its outputs hold one step's tokens each
            with http.stream("POST", f"{base}/v1/completions", json=streamed) as response:
                assert "data: [DONE]" in list(response.iter_lines())  # read to the end
            while len([f for e in events[1:] for f in e["finished"]]) < 2:
                events.append(next_event())
            long = {"model": "tiny", "prompt": "Hang up on me", "max_tokens": 200, "ignore_eos": True, "stream": True}
            with http.stream("POST", f"{base}/v1/completions", json=long) as hung_up:
                next(line for line in hung_up.iter_lines() if line.startswith("data: "))  # one chunk, then leave
            while not any(f["reason"] == "abort" for e in events[1:] for f in e["finished"]):
                events.append(next_event())
        assert events[0]["type"] == "hello" and events[0]["model"] == "tiny"
        for event in events:
            event_protocol.EngineEvent.model_validate({"event": event})
        assert any(s["index"] == 1 for e in events[1:] for s in e["running"]), "both completions of n = 2 show"
        finished = [f for e in events[1:] for f in e["finished"]]
        assert [f["reason"] for f in finished] == ["length", "length", "abort"]
        assert [f["output_tokens"] for f in finished[:2]] == [16, 12], "every completion's tokens, streamed or not"
        assert all(f["arrival"] <= e["time"] for e in events[1:] for f in e["finished"] if f["arrival"] is not None)
        metrics = httpx.get(f"{base}/metrics").text
        assert "llm_runtime_engine_event_subscribers " in metrics
        deadline = time.time() + 10
        while engine_subscribers(base) != 0:  # the client left: the server unsubscribed it
            assert time.time() < deadline
            time.sleep(0.1)


def engine_subscribers(base: str) -> float:
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith("llm_runtime_engine_event_subscribers "):
            return float(line.split()[1])
    raise AssertionError("no subscriber gauge")


def test_views_beyond_the_limit_get_503_and_a_freed_place_is_taken_again(tiny_chat_model) -> None:
    model, tokenizer = tiny_chat_model
    app = create_app(LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=16)), "tiny")
    app.state.async_engine.feed.max_subscribers = 1
    with running(app) as base, httpx.Client(timeout=30) as http:
        def first_event(stream) -> dict:  # (subscribed once its hello has come; read with one iterator, kept open)
            stream.lines = stream.iter_lines()
            return next(json.loads(line[len("data: "):]) for line in stream.lines if line.startswith("data: "))

        with http.stream("GET", f"{base}/v1/engine/events") as first:
            assert first_event(first)["type"] == "hello"
            with http.stream("GET", f"{base}/v1/engine/events") as refused:
                assert refused.status_code == 503  # an error answer, not a stream: nothing to read forever
                assert "1 live views are open already" in json.loads(refused.read())["error"]["message"]
        deadline = time.time() + 10
        while engine_subscribers(base) != 0:  # the first view left: its place is free
            assert time.time() < deadline
            time.sleep(0.05)
        with http.stream("GET", f"{base}/v1/engine/events") as again:
            assert again.status_code == 200 and first_event(again)["type"] == "hello"


def test_a_stuck_connection_is_dropped_and_requests_get_the_same_tokens(tiny_chat_model) -> None:
    model, tokenizer = tiny_chat_model
    config = EngineConfig(num_kv_blocks=4096, max_num_seqs=8)  # 4 KB of block states an event: buffers fill fast
    params = {"model": "tiny", "max_tokens": 48, "ignore_eos": True, "temperature": 0}
    prompts = [f"Request number {i} says" for i in range(8)]

    async def load(base: str) -> list[str]:
        async with httpx.AsyncClient(timeout=60) as http:
            responses = await asyncio.gather(*(http.post(f"{base}/v1/completions", json={**params, "prompt": p})
                                               for p in prompts))
        return [r.json()["choices"][0]["text"] for r in responses]

    with running(create_app(LLMEngine(model, tokenizer, config), "tiny")) as base:
        alone = asyncio.run(load(base))
    app = create_app(LLMEngine(model, tokenizer, config), "tiny")
    with running(app) as base:
        app.state.async_engine.feed.max_queued = 4
        app.state.async_engine.feed.interval_s = 0
        port = int(base.rsplit(":", 1)[1])
        stuck = socket.socket()
        stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)  # and it never reads
        stuck.connect(("127.0.0.1", port))
        stuck.sendall(b"GET /v1/engine/events HTTP/1.1\r\nHost: x\r\n\r\n")
        try:
            deadline = time.time() + 10
            while engine_subscribers(base) != 1:
                assert time.time() < deadline, "the stuck client never subscribed"
                time.sleep(0.05)
            watched = []
            for _ in range(40):  # until its socket's buffers and its queue overflow (5 loads here)
                watched += asyncio.run(load(base))
                if app.state.async_engine.feed.num_dropped:
                    break
            assert app.state.async_engine.feed.num_dropped == 1, "the stuck subscriber was never dropped"
            assert engine_subscribers(base) == 0
            assert watched[:len(prompts)] == alone, "a stuck subscriber changed what the requests got"
            assert "llm_runtime_engine_event_subscribers_dropped_total 1.0" in httpx.get(f"{base}/metrics").text
        finally:
            stuck.close()


def test_a_server_stops_with_an_event_stream_open(tiny_chat_model) -> None:
    model, tokenizer = tiny_chat_model
    engine = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=16))
    started = time.monotonic()
    with running(create_app(engine, "tiny")) as base:
        reader = socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1])))
        reader.sendall(b"GET /v1/engine/events HTTP/1.1\r\nHost: x\r\n\r\n")
        reader.settimeout(10)
        received = b""
        while b"event: state" not in received:  # the hello, then the state it found: the stream is open
            received += reader.recv(65536)
    assert time.monotonic() - started < 20, "the open stream held the server's shutdown up"
    reader.close()


def test_a_stop_signal_ends_the_event_streams_and_later_ones_at_once(tiny_chat_model) -> None:
    import signal

    import uvicorn

    from llm_runtime.serving.server import Server

    model, tokenizer = tiny_chat_model
    app = create_app(LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=16)), "tiny")
    feed = app.state.async_engine.feed
    server = Server(uvicorn.Config(app), on_exit=feed.close)

    async def scenario() -> None:
        subscription = feed.subscribe()
        server.handle_exit(signal.SIGTERM, None)  # as uvicorn's signal handler calls it
        assert [event["type"] async for event in subscription] == ["hello"]  # the stream ends
        assert server.should_exit and feed.subscribers == [] and not subscription.dropped
        assert feed.subscribe().closed

    asyncio.run(scenario())


def test_a_step_that_runs_nothing_leaves_no_record(tiny_chat_model) -> None:
    model, tokenizer = tiny_chat_model
    engine = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=16))
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=1))
    engine.step()
    assert engine.last_step is not None and engine.last_step.items[0][0] == "a"
    engine.step()  # nothing left to run
    assert engine.last_step is None


def test_a_large_pools_block_states_come_less_often_than_the_events(tiny_chat_model) -> None:
    model, tokenizer = tiny_chat_model
    engine = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=64))
    feed = EngineFeed(engine, interval_s=0)
    subscription = feed.subscribe()
    feed.observe()  # the new subscriber's state: always whole
    slow = feed.kv_states
    feed.kv_states = lambda: (time.sleep(0.002), slow())[1]  # as a pool of about 200,000 blocks would take
    for request_id, prompt, max_tokens in _requests(2, max_tokens=20):
        engine.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    while engine.has_unfinished_requests():
        feed.observe(engine.step(), stepped=True)
    states = _events(subscription)[1:]
    built = [e["kv"] is not None for e in states]
    assert built[0] and built[-1], "the first state and the idle one carry the pool"
    assert 0 < sum(built[1:-1]) < len(built) - 2, "in between, only some do (once 50 build times passed)"

