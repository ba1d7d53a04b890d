"""The router (serving/router.py) as a careless operator and a hostile client meet it, in front of stub backends
that record what they are sent (no model: milliseconds a request): a slow health probe does not end the requests
in flight (a backend leaves the rotation after missing several in a row); a decode server's receiving address is
read again at every probe, and one bound to every interface is reached at its URL's host; the prefill leg leaves
out what only shapes the output (min_tokens >= 2 was refused there); a client's kv_transfer_params never reach a
backend, and with a secret the router's own are signed; a list of prompts is split into legs and merged, streamed
or not; bodies are bounded and the API key is asked for and passed on."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from llm_runtime.kv_transfer.trust import signed_by
from llm_runtime.serving import router as router_module
from llm_runtime.serving.router import create_router
from servers import running


class Stub:
    """A backend that answers like a server, records every body it is sent, and can be told to be slow."""

    def __init__(self, kv_ip: str = "127.0.0.1", kv_port: int = 14580) -> None:
        self.bodies: list[dict] = []
        self.headers: list[dict] = []
        self.kv = {"kv_role": "kv_both", "kv_connector": "ZmqConnector", "kv_ip": kv_ip, "kv_port": kv_port}
        self.health_delay_s = 0.0
        self.answer_delay_s = 0.0
        self.app = self._app()

    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health():
            await asyncio.sleep(self.health_delay_s)
            return {"status": "ok"}

        @app.get("/v1/kv_transfer")
        async def kv_transfer():
            return self.kv

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = await request.json()
            self.bodies.append(body)
            self.headers.append(dict(request.headers))
            await asyncio.sleep(self.answer_delay_s)
            text = f"<{body['prompt']}>"
            usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
            if not body.get("stream"):
                return JSONResponse({"id": "c", "object": "text_completion", "model": "m", "usage": usage,
                                     "choices": [{"index": 0, "text": text, "finish_reason": "length"}]})

            async def events():
                for piece in (text[:2], text[2:]):
                    yield f"data: {json.dumps({'id': 'c', 'choices': [{'index': 0, 'text': piece}]})}\n\n"
                    await asyncio.sleep(0.01)
                if (body.get("stream_options") or {}).get("include_usage"):
                    yield f"data: {json.dumps({'id': 'c', 'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        return app


def _post(router: str, **body) -> httpx.Response:
    return httpx.post(f"{router}/v1/completions", json={"prompt": "p", "max_tokens": 4, **body}, timeout=30)


def test_a_slow_probe_ends_no_request_and_three_in_a_row_take_the_backend_out(monkeypatch) -> None:
    monkeypatch.setattr(router_module, "HEALTH_TIMEOUT_S", 0.3)
    monkeypatch.setattr(router_module, "HEALTH_INTERVAL_S", 0.1)
    stub = Stub()
    with running(stub.app) as backend, running(create_router(replicas=[backend])) as router:
        stub.health_delay_s, stub.answer_delay_s = 0.5, 1.5  # every probe late while a request runs
        started = time.monotonic()
        answer = _post(router)
        assert answer.status_code == 200 and time.monotonic() - started >= 1.5  # before: 502 at the first late probe
        deadline = time.monotonic() + 10
        while _post(router).status_code != 503:  # it missed 3 probes in a row: out of rotation for new requests
            assert time.monotonic() < deadline
        assert router_module.MISSED_PROBES == 3
        stub.health_delay_s = stub.answer_delay_s = 0.0
        deadline = time.monotonic() + 10
        while _post(router).status_code != 200:  # back as soon as it answers a probe in time
            assert time.monotonic() < deadline
            time.sleep(0.1)


def test_the_decode_address_is_read_again_and_every_interface_means_the_urls_host(monkeypatch) -> None:
    monkeypatch.setattr(router_module, "HEALTH_INTERVAL_S", 0.1)
    prefill, decode = Stub(), Stub(kv_ip="0.0.0.0", kv_port=15001)
    with running(prefill.app) as p, running(decode.app) as d, running(create_router(prefill=[p], decode=[d])) as router:
        assert _post(router).status_code == 200
        params = prefill.bodies[-1]["kv_transfer_params"]
        assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", 15001)  # not 0.0.0.0
        decode.kv = {**decode.kv, "kv_ip": "127.0.0.1", "kv_port": 15002}  # the decode server restarted
        time.sleep(0.5)
        assert _post(router).status_code == 200
        assert prefill.bodies[-1]["kv_transfer_params"]["remote_port"] == 15002


def test_the_prefill_leg_asks_only_for_the_prompts_kv_and_client_params_never_pass() -> None:
    prefill, decode = Stub(), Stub()
    forged = {"do_remote_decode": True, "transfer_id": "x", "remote_host": "10.0.0.9", "remote_port": 6379}
    with running(prefill.app) as p, running(decode.app) as d, running(create_router(prefill=[p], decode=[d])) as router:
        answer = _post(router, min_tokens=3, logprobs=2, prompt_logprobs=1, echo=False, kv_transfer_params=forged)
        assert answer.status_code == 200
    first, rest = prefill.bodies[-1], decode.bodies[-1]
    assert first["max_tokens"] == 1 and not {"min_tokens", "logprobs", "prompt_logprobs", "echo"} & set(first)
    assert first["kv_transfer_params"]["remote_port"] == 14580 and first["kv_transfer_params"]["transfer_id"] != "x"
    assert rest["min_tokens"] == 3 and rest["logprobs"] == 2 and rest["max_tokens"] == 4
    assert rest["kv_transfer_params"] == {"do_remote_prefill": True,
                                          "transfer_id": first["kv_transfer_params"]["transfer_id"]}
    replica = Stub()
    with running(replica.app) as r, running(create_router(replicas=[r])) as router:
        assert _post(router, kv_transfer_params=forged).status_code == 200
    assert "kv_transfer_params" not in replica.bodies[-1]


def test_with_a_secret_the_routers_params_are_signed() -> None:
    secret = "the-secret-all-servers-share"
    prefill, decode = Stub(), Stub()
    with running(prefill.app) as p, running(decode.app) as d, \
            running(create_router(prefill=[p], decode=[d], kv_secret=secret)) as router:
        assert _post(router).status_code == 200
    assert signed_by(secret, prefill.bodies[-1]["kv_transfer_params"])
    assert signed_by(secret, decode.bodies[-1]["kv_transfer_params"])
    assert not signed_by("another-secret-entirely", decode.bodies[-1]["kv_transfer_params"])


def test_a_list_of_prompts_is_split_into_legs_and_merged() -> None:
    prefill, decode = Stub(), Stub()
    prompts = ["a", "bb", "ccc"]
    with running(prefill.app) as p, running(decode.app) as d, running(create_router(prefill=[p], decode=[d])) as router:
        answer = _post(router, prompt=prompts)
        assert answer.status_code == 200, answer.text
        merged = answer.json()
        assert [c["text"] for c in merged["choices"]] == ["<a>", "<bb>", "<ccc>"]
        assert [c["index"] for c in merged["choices"]] == [0, 1, 2] and merged["usage"]["total_tokens"] == 15
        texts, usage, done = {}, None, 0
        with httpx.stream("POST", f"{router}/v1/completions", timeout=30, json={
                "prompt": prompts, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}) as s:
            for line in s.iter_lines():
                if line == "data: [DONE]":
                    done += 1
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    for choice in event["choices"]:
                        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
                    usage = event.get("usage") or usage
        assert texts == {0: "<a>", 1: "<bb>", 2: "<ccc>"} and usage["total_tokens"] == 15 and done == 1
    assert sorted(body["prompt"] for body in prefill.bodies) == sorted(prompts * 2)
    assert len({body["kv_transfer_params"]["transfer_id"] for body in prefill.bodies}) == 6


def test_bodies_are_bounded_and_the_api_key_is_asked_for_and_passed_on() -> None:
    replica = Stub()
    with running(replica.app) as r, running(create_router(replicas=[r], api_key="client-key",
                                                          backend_api_key="backend-key",
                                                          max_request_bytes=1000)) as router:
        assert _post(router).status_code == 401
        assert httpx.get(f"{router}/health").status_code == 200  # open, as vLLM leaves it
        headers = {"Authorization": "Bearer client-key"}
        assert httpx.post(f"{router}/v1/completions", json={"prompt": "p"}, headers=headers).status_code == 200
        assert replica.headers[-1]["authorization"] == "Bearer backend-key"
        big = httpx.post(f"{router}/v1/completions", json={"prompt": "p" * 2000}, headers=headers)
        assert big.status_code == 413


def test_a_requests_legs_are_bounded_and_its_fields_checked_before_any_leg() -> None:
    prefill, decode = Stub(), Stub()
    with running(prefill.app) as p, running(decode.app) as d, running(create_router(prefill=[p], decode=[d])) as router:
        many = _post(router, prompt=[f"p{i}" for i in range(router_module.MAX_PROMPTS + 1)])
        assert many.status_code == 400 and "at most 16 prompts" in many.json()["error"]["message"]
        assert _post(router, stream=True, stream_options="yes").status_code == 400  # (was a 500)
    assert not prefill.bodies  # nothing was prefilled, so no KV was shipped for a refused request


def test_a_decode_address_only_its_own_machine_reaches_is_not_used() -> None:
    from llm_runtime.serving.router import Router
    from llm_runtime.serving.router_policy import Backend

    remote, local = Backend("http://10.0.0.3:8200", "decode"), Backend("http://127.0.0.1:8200", "decode")
    assert Router._kv_address(remote, {"kv_ip": "0.0.0.0", "kv_port": 5}) == ("10.0.0.3", 5)
    assert Router._kv_address(remote, {"kv_ip": "127.0.0.1", "kv_port": 5}) is None  # producers elsewhere: unreachable
    assert Router._kv_address(local, {"kv_ip": "127.0.0.1", "kv_port": 5}) == ("127.0.0.1", 5)
    assert Router._kv_address(remote, {"kv_ip": "10.0.0.3", "kv_port": True}) is None
