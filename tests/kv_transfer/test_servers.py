"""A prefill server and a decode server (serving/kv_agent.py, serving/, lesson 18), over the bundled model on
loopback: the producer computes a prompt and ships its blocks over ZeroMQ, the consumer takes them in and decodes
the same greedy text as one server alone, computing only the prompt's tail; /metrics counts what moved. Requests
whose kv_transfer_params this server's role cannot serve are refused; a decode request whose blocks never come
computes its prompt itself after the timeout."""

from __future__ import annotations

import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "serving"))
from servers import MODEL_NAME, TEST_KV_MEMORY, running  # noqa: E402

from llm_runtime import EngineConfig, LLMEngine  # noqa: E402
from llm_runtime.kv_transfer.config import KVTransferConfig  # noqa: E402
from llm_runtime.serving.server import create_app  # noqa: E402

pytestmark = pytest.mark.slow
PROMPT = ("You are a careful assistant. Here are the facts you may use: the library opens at nine, closes at "
          "five, lends books for three weeks, and charges nothing for renewals made before the due date. "
          "Question: how long can I keep a book if I renew it once?")


def _server(bundled, role: str | None, timeout_s: float = 30.0):
    model, tokenizer = bundled
    engine = LLMEngine(model, tokenizer, EngineConfig(kv_cache_memory=TEST_KV_MEMORY, compile_model=False))
    config = None if role is None else KVTransferConfig(kv_role=role, kv_port=0 if role != "kv_producer" else 14579,
                                                         kv_transfer_timeout_s=timeout_s)
    return engine, create_app(engine, MODEL_NAME, kv_transfer_config=config)


def _complete(base: str, **fields) -> dict:
    body = {"model": MODEL_NAME, "prompt": PROMPT, "temperature": 0, "max_tokens": 16, **fields}
    response = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def _metric(base: str, name: str) -> float:
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith(f"llm_runtime_{name} "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


def test_the_decode_server_continues_the_prefill_servers_prompt(bundled) -> None:
    alone_engine, alone = _server(bundled, None)
    producer_engine, producer = _server(bundled, "kv_producer")
    consumer_engine, consumer = _server(bundled, "kv_consumer")
    try:
        with running(alone) as alone_url, running(producer) as prefill_url, running(consumer) as decode_url:
            expected = _complete(alone_url)["choices"][0]["text"]
            info = httpx.get(f"{decode_url}/v1/kv_transfer").json()
            assert info["kv_role"] == "kv_consumer" and info["kv_port"] > 0
            assert httpx.get(f"{alone_url}/v1/kv_transfer").status_code == 404
            transfer_id = uuid.uuid4().hex
            first = _complete(prefill_url, max_tokens=1, kv_transfer_params={
                "do_remote_decode": True, "transfer_id": transfer_id, "remote_host": info["kv_ip"],
                "remote_port": info["kv_port"]})
            prompt_tokens = first["usage"]["prompt_tokens"]
            got = _complete(decode_url, kv_transfer_params={"do_remote_prefill": True, "transfer_id": transfer_id})
            assert got["choices"][0]["text"] == expected
            sent, received = _metric(prefill_url, "kv_transfer_sent_tokens_total"), _metric(
                decode_url, "kv_transfer_received_tokens_total")
            block = consumer_engine.config.block_size
            assert sent == received == (prompt_tokens - 1) // block * block  # the whole blocks before the last token
            assert _metric(decode_url, "prefix_cache_hits_total") == received  # the consumer computed the rest only
            assert _metric(decode_url, "kv_transfer_sent_bytes_total") == 0
            # Roles: a consumer ships nothing, a server without a config takes no params at all.
            refused = httpx.post(f"{decode_url}/v1/completions", json={
                "prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": {
                    "do_remote_decode": True, "transfer_id": "x", "remote_host": "127.0.0.1", "remote_port": 1}})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "kv_transfer_params"
            refused = httpx.post(f"{alone_url}/v1/completions", json={
                "prompt": PROMPT, "kv_transfer_params": {"do_remote_prefill": True, "transfer_id": "y"}})
            assert refused.status_code == 400 and "--kv-transfer-config" in refused.json()["error"]["message"]
    finally:
        for engine in (alone_engine, producer_engine, consumer_engine):
            engine.shutdown()


def test_a_decode_request_whose_blocks_never_come_computes_its_prompt(bundled) -> None:
    alone_engine, alone = _server(bundled, None)
    consumer_engine, consumer = _server(bundled, "kv_consumer", timeout_s=1.0)
    try:
        with running(alone) as alone_url, running(consumer) as decode_url:
            expected = _complete(alone_url)["choices"][0]["text"]
            started = time.monotonic()
            got = _complete(decode_url, kv_transfer_params={"do_remote_prefill": True, "transfer_id": "never"})
            assert got["choices"][0]["text"] == expected
            assert 1.0 <= time.monotonic() - started < 15
            assert _metric(decode_url, "kv_transfer_received_tokens_total") == 0
    finally:
        alone_engine.shutdown()
        consumer_engine.shutdown()
