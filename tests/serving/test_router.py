"""The router (serving/router.py, lesson 18): its policies by themselves, then in front of real servers over the
bundled model on loopback: replicas chosen round-robin or by cached prefix (hit rates from the replicas' own
counters), a prefill and a decode server giving one server's text, streamed and not; a backend that goes away
answered 502 then 503 quickly; prefill and decode servers killed as processes (a prefill retried on the other
prefill server, a dead decode server answered 502/503 while the prefill servers keep serving); a client that
leaves aborts its request upstream."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import uvicorn

from llm_runtime import EngineConfig, LLMEngine
from llm_runtime.kv_transfer.config import KVTransferConfig
from llm_runtime.lessons.disaggregation import ServerProcess
from llm_runtime.serving.router import create_router
from llm_runtime.serving.router_policy import Backend, Pool, chunk_hashes
from llm_runtime.serving.server import create_app
from servers import MODEL_NAME, TEST_KV_MEMORY, free_port, running, wait_idle

SYSTEMS = [f"You are assistant number {i}. " + "Answer briefly, politely and only with facts you are sure of. " * 4
           for i in range(6)]  # 6 long shared prefixes


def test_policies() -> None:
    a, b, c = Backend("a", "replica"), Backend("b", "replica"), Backend("c", "replica")
    turns = Pool([a, b, c], "round_robin")
    assert [turns.choose("x").url for _ in range(4)] == ["a", "b", "c", "a"]
    b.healthy = False
    assert {turns.choose("x").url for _ in range(4)} == {"a", "c"}
    a.in_flight, c.in_flight = 3, 1
    assert Pool([a, b, c], "least_loaded").choose("x") is c
    cache = Pool([a, c], "cache_aware")
    long_prompt = "p" * 400
    first = cache.choose(long_prompt)
    assert first is c  # never seen: the least loaded
    a.in_flight, c.in_flight = 0, 5
    assert cache.choose(long_prompt + " and a new question") is c  # the cached prefix wins over the load
    assert cache.choose("q" * 400) is a  # an unseen prompt goes to the least loaded
    a.healthy = c.healthy = False
    assert cache.choose(long_prompt) is None
    assert len(chunk_hashes("x" * 130)) == 2 and chunk_hashes("ab" * 64)[0] != chunk_hashes("ba" * 64)[0]
    with pytest.raises(ValueError, match="policy must be one of"):
        Pool([a], "random")
    with pytest.raises(ValueError, match="both --prefill and --decode"):
        create_router(prefill=["http://x"])
    with pytest.raises(ValueError, match="not both"):
        create_router(prefill=["http://x"], decode=["http://y"], replicas=["http://z"])


def _engine(bundled) -> LLMEngine:
    model, tokenizer = bundled
    return LLMEngine(model, tokenizer, EngineConfig(kv_cache_memory=TEST_KV_MEMORY, compile_model=False))


def _chat(base: str, system: str, question: str, stream: bool = False, max_tokens: int = 12) -> str:
    body = {"model": MODEL_NAME, "temperature": 0, "max_tokens": max_tokens, "stream": stream, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": question}]}
    if not stream:
        answer = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        return answer.json()["choices"][0]["message"]["content"]
    text = []
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120) as answer:
        assert answer.status_code == 200
        for line in answer.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                import json

                event = json.loads(line[6:])
                assert "error" not in event, event
                text.append(event["choices"][0]["delta"].get("content") or "")
    return "".join(text)


def _counter(base: str, name: str) -> float:
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith(f"llm_runtime_{name} "):
            return float(line.split()[1])
    raise AssertionError(name)


@pytest.mark.slow
def test_cache_aware_routing_keeps_prefixes_together(bundled) -> None:
    questions = ["What time is it?", "Name a color.", "Say hello."]
    rates = {}
    for policy in ("round_robin", "cache_aware"):
        engines = [_engine(bundled), _engine(bundled)]
        try:
            with running(create_app(engines[0], MODEL_NAME)) as one, running(create_app(engines[1], MODEL_NAME)) as two:
                with running(create_router(replicas=[one, two], policy=policy)) as router:
                    for system in SYSTEMS:  # a group's requests one after another: round-robin splits them
                        for question in questions:
                            _chat(router, system, question, max_tokens=2)
                hits = sum(_counter(url, "prefix_cache_hits_total") for url in (one, two))
                queries = sum(_counter(url, "prefix_cache_queries_total") for url in (one, two))
                rates[policy] = hits / queries
        finally:
            for engine in engines:
                engine.shutdown()
    assert rates["cache_aware"] > rates["round_robin"] + 0.1, rates


@pytest.mark.slow
def test_a_prefill_and_a_decode_server_answer_as_one_server(bundled) -> None:
    engines = [_engine(bundled) for _ in range(3)]
    alone = create_app(engines[0], MODEL_NAME)
    producer = create_app(engines[1], MODEL_NAME, kv_transfer_config=KVTransferConfig(kv_role="kv_producer"))
    consumer = create_app(engines[2], MODEL_NAME, kv_transfer_config=KVTransferConfig(kv_role="kv_consumer",
                                                                                       kv_port=0))
    try:
        with running(alone) as alone_url, running(producer) as prefill, running(consumer) as decode:
            with running(create_router(prefill=[prefill], decode=[decode])) as router:
                for i, system in enumerate(SYSTEMS[:3]):
                    expected = _chat(alone_url, system, "What is your number?")
                    assert _chat(router, system, "What is your number?", stream=bool(i % 2)) == expected
                assert _counter(decode, "kv_transfer_received_tokens_total") > 0
                assert _counter(decode, "kv_transfer_received_tokens_total") == \
                    _counter(prefill, "kv_transfer_sent_tokens_total")
                wait_idle(engines[2])
    finally:
        for engine in engines:
            engine.shutdown()


@pytest.mark.slow
def test_a_backend_that_goes_away_gets_502_then_503_never_a_hang(bundled) -> None:
    engine = _engine(bundled)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(engine, MODEL_NAME), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        with running(create_router(replicas=[f"http://127.0.0.1:{port}"])) as router:
            assert _chat(router, SYSTEMS[0], "Hi", max_tokens=2)
            server.should_exit = True
            thread.join(timeout=30)
            started = time.monotonic()
            statuses = set()
            for _ in range(3):
                answer = httpx.post(f"{router}/v1/chat/completions", timeout=30, json={
                    "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
                statuses.add(answer.status_code)
                assert answer.json()["error"]["message"]
            assert statuses <= {502, 503} and time.monotonic() - started < 30
            time.sleep(2)  # the health check has seen it by now
            assert httpx.post(f"{router}/v1/completions", json={"prompt": "Hi"}).status_code == 503
            assert httpx.get(f"{router}/health").status_code == 503
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_a_client_that_leaves_aborts_its_request_upstream(bundled) -> None:
    engine = _engine(bundled)
    try:
        with running(create_app(engine, MODEL_NAME)) as replica, running(create_router(replicas=[replica])) as router:
            body = {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 400,
                    "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{router}/v1/chat/completions", json=body, timeout=60) as answer:
                next(answer.iter_lines())
            wait_idle(engine)  # aborted upstream, long before 400 tokens
            assert _counter(replica, "requests_aborted_total") == 1
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{router}/v1/chat/completions", timeout=0.5, json={**body, "stream": False})
            wait_idle(engine)
            assert _counter(replica, "requests_aborted_total") == 2
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_killed_prefill_and_decode_servers() -> None:
    common = ["--device", "cpu", "--dtype", "float32", "--enforce-eager", "--kv-cache-memory", str(TEST_KV_MEMORY)]
    producers = [ServerProcess.serve([*common, "--kv-transfer-config", '{"kv_role": "kv_producer"}'], threads=1,
                                     wait=False) for _ in range(2)]
    consumer = ServerProcess.serve([*common, "--kv-transfer-config", '{"kv_role": "kv_consumer", "kv_port": 0}'],
                                   threads=1, wait=False)
    try:
        for server in (*producers, consumer):
            server.wait_ready()
        with running(create_router(prefill=[p.url for p in producers], decode=[consumer.url])) as router:
            expected = [_chat(router, system, "What is your number?", max_tokens=6) for system in SYSTEMS[:2]]
            producers[0].kill()  # the other prefill server takes every prefill, the failed ones retried there
            assert [_chat(router, system, "What is your number?", max_tokens=6, stream=i == 1)
                    for i, system in enumerate(SYSTEMS[:2])] == expected
            assert _chat(router, SYSTEMS[2], "Hi", max_tokens=2)
            kv_address = httpx.get(f"{consumer.url}/v1/kv_transfer").json()
            consumer.kill()
            started = time.monotonic()
            statuses = []
            for _ in range(3):
                answer = httpx.post(f"{router}/v1/chat/completions", timeout=30, json={
                    "messages": [{"role": "system", "content": SYSTEMS[3]}, {"role": "user", "content": "Hi"}],
                    "max_tokens": 2})
                statuses.append(answer.status_code)
                assert answer.json()["error"]["message"]
            assert set(statuses) <= {502, 503} and time.monotonic() - started < 30
            while httpx.get(f"{router}/health").status_code != 503:  # the health check sees it within a second
                assert time.monotonic() - started < 30
                time.sleep(0.1)
            answer = httpx.post(f"{router}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
            assert answer.status_code == 503 and "no healthy decode server" in answer.json()["error"]["message"]
            # A prefill whose consumer is dead: the send fails on the sender's thread, and the server's steps go on.
            shipped = {"prompt": SYSTEMS[4], "max_tokens": 1, "kv_transfer_params": {
                "do_remote_decode": True, "transfer_id": "to-the-dead", "remote_host": kv_address["kv_ip"],
                "remote_port": kv_address["kv_port"]}}
            for body in (shipped, {"prompt": "Hi", "max_tokens": 2}):
                assert httpx.post(f"{producers[1].url}/v1/completions", json=body, timeout=30).status_code == 200
            deadline = time.monotonic() + 30
            while _counter(producers[1].url, "kv_transfer_send_failures_total") < 1:
                assert time.monotonic() < deadline, "the send to the dead consumer never failed"
                time.sleep(0.2)
    finally:
        for server in (*producers, consumer):
            server.kill()
