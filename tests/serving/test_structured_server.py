"""Structured output through the server (lesson 15), spoken to with the `openai` client: vLLM's
`structured_outputs` on chat and text completions, OpenAI's `response_format` and `tools` with a named or
"required" `tool_choice`, streamed and not, greedy and sampled; every answer parses and validates. Bad
constraints get a 400 naming the field, and the server stays healthy with nothing left running."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from servers import MODEL_NAME, bundled_server, openai_client, wait_idle
from structured_cases import CONSTRAINTS, PERSON, PHONE, finished_valid, valid

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")
pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                   "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 24}},
                   "required": ["zone"], "additionalProperties": False}}}
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, TIME)}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(bundled):
    with bundled_server(bundled, max_num_seqs=16, max_num_batched_tokens=512) as running_server:
        yield running_server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai_client(server[0])


def _chat(client: openai.OpenAI, messages, stream: bool, **kwargs) -> tuple[str, str, list]:
    """(content, finish_reason, tool calls as (name, arguments)) of one chat completion, streamed or not."""
    if not stream:
        choice = client.chat.completions.create(model=MODEL_NAME, messages=messages, **kwargs).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return choice.message.content or "", choice.finish_reason, calls
    content, finish, calls = "", None, {}
    for chunk in client.chat.completions.create(model=MODEL_NAME, messages=messages, stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                if delta.index not in calls:  # the first piece of a call carries its id and name
                    assert delta.id and delta.function.name
                    calls[delta.index] = [delta.function.name, ""]
                calls[delta.index][1] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, finish, [tuple(call) for _, call in sorted(calls.items())]


SAMPLINGS = [dict(temperature=0, stream=False), dict(temperature=1.0, seed=1, stream=True),
             dict(temperature=1.0, seed=2, stream=False)]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "seed1-stream", "seed2"])
def test_every_constraint_kind_through_the_openai_client(client, sampling: dict) -> None:
    sampling = dict(sampling)
    stream = sampling.pop("stream")
    for kind, (question, structured) in CONSTRAINTS.items():
        field = {kind: json.loads(structured.json) if kind == "json" else getattr(structured, kind)}
        text, finish, _ = _chat(client, [{"role": "user", "content": question}], stream, max_tokens=160,
                                extra_body={"structured_outputs": field}, **sampling)
        assert finished_valid(kind, text, finish, sampled="seed" in sampling), (kind, finish, text)
    text, finish, _ = _chat(client, [{"role": "user", "content": CONSTRAINTS["json"][0]}], stream, max_tokens=160,
                            response_format={"type": "json_schema", "json_schema": {
                                "name": "person", "schema": PERSON, "strict": True}}, **sampling)
    assert finish == "stop" and valid("json", text), text
    text, finish, _ = _chat(client, [{"role": "user", "content": CONSTRAINTS["json_object"][0]}], stream,
                            max_tokens=160, response_format={"type": "json_object"}, **sampling)
    assert finished_valid("json_object", text, finish, sampled="seed" in sampling), (finish, text)
    completion = client.completions.create(model=MODEL_NAME, prompt="Call me at", max_tokens=32,
                                           extra_body={"structured_outputs": {"regex": " " + PHONE}}, **sampling)
    assert completion.choices[0].finish_reason == "stop" and valid("regex", completion.choices[0].text[1:])


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "seed1-stream", "seed2"])
def test_tool_calls_satisfy_the_functions_parameters(client, sampling: dict) -> None:
    sampling = dict(sampling)
    stream = sampling.pop("stream")
    content, finish, calls = _chat(client, QUESTION, stream, max_tokens=64, tools=[WEATHER, TIME],
                                   tool_choice={"type": "function", "function": {"name": "get_weather"}}, **sampling)
    assert (content, finish, len(calls)) == ("", "stop", 1) and calls[0][0] == "get_weather"
    jsonschema.validate(json.loads(calls[0][1]), SCHEMAS["get_weather"])
    content, finish, calls = _chat(client, QUESTION, stream, max_tokens=128, tools=[WEATHER, TIME],
                                   tool_choice="required", **sampling)
    assert content == "" and finish == "tool_calls" and calls, (content, finish)
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_a_conversation_with_earlier_calls_and_their_results_is_answered(client) -> None:
    messages = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call-1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call-1", "content": '{"temperature": 21, "sky": "clear"}'}]
    text, finish, calls = _chat(client, messages, False, max_tokens=24, temperature=0, tools=[WEATHER],
                                tool_choice="none")
    assert text and not calls and finish in ("stop", "length")


def test_logprobs_under_a_mask_are_finite(client) -> None:
    """Tokens the grammar forbids have logprob -inf after the mask; JSON has no infinity: -9999.0 is sent."""
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": CONSTRAINTS["choice"][0]}], temperature=0,
        logprobs=True, top_logprobs=20, extra_body={"structured_outputs": {"choice": ["Paris", "London"]}})
    entries = response.choices[0].logprobs.content
    assert entries and all(-9999.0 <= top.logprob <= 0 for entry in entries for top in entry.top_logprobs)
    assert any(top.logprob == -9999.0 for entry in entries for top in entry.top_logprobs)


BAD = [
    ({"extra_body": {"structured_outputs": {"regex": "(a"}}}, "structured_outputs.regex"),
    ({"extra_body": {"structured_outputs": {"json": {"type": "nonsense"}}}}, "structured_outputs.json"),
    ({"extra_body": {"structured_outputs": {"choice": []}}}, "structured_outputs.choice"),
    ({"extra_body": {"structured_outputs": {"grammar": "root ::= missing"}}}, "structured_outputs.grammar"),
    ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["a"]}}}, "structured_outputs"),
    ({"extra_body": {"structured_outputs": {}}}, "structured_outputs"),
    ({"extra_body": {"structured_outputs": {"regex": "a+"}, "min_tokens": 2}}, "min_tokens"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"structured_outputs": {"regex": "a"}}},
     "response_format"),
    ({"tools": [WEATHER]}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}], "tool_choice": "required"}, "tools"),
]


@pytest.mark.parametrize("kwargs, field", BAD, ids=[f"{i}-{field}" for i, (_, field) in enumerate(BAD)])
def test_a_bad_constraint_is_a_400_naming_its_field(server, client, kwargs: dict, field: str) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=8, **kwargs)
    assert refused.value.body["param"] == field, refused.value.body
    base, engine, _ = server
    assert httpx.get(f"{base}/health").json() == {"status": "ok"}
    wait_idle(engine)
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == 0 and stats.num_free_blocks == stats.num_total_blocks


def test_text_completions_take_a_bad_constraint_as_a_400(client) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=8,
                                  extra_body={"structured_outputs": {"regex": "[z-a]"}})
    assert refused.value.body["param"] == "structured_outputs.regex"


def test_compiles_past_the_bound_get_503_and_plain_requests_go_on(server, monkeypatch) -> None:
    """One slow compile in flight with room for one: a request with another new constraint is answered 503 at once
    (server_busy), an unconstrained request is served meanwhile, and once the compile ends both kinds are served."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    base, engine, _ = server
    compiler = engine.input_processor.grammar_compiler()
    real, release = compiler._compile_now, threading.Event()

    def slow(params):
        if params.regex == "held|back":
            release.wait(30)
        return real(params)

    monkeypatch.setattr(compiler, "_compile_now", slow)
    monkeypatch.setattr(compiler, "max_pending", 1)

    def complete(**fields):
        return httpx.post(f"{base}/v1/completions", json={"model": MODEL_NAME, "prompt": "Say", "max_tokens": 4,
                                                          "temperature": 0, **fields}, timeout=60)

    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(complete, structured_outputs={"regex": "held|back"})
        while compiler.num_pending == 0:
            threading.Event().wait(0.01)
        busy = complete(structured_outputs={"regex": "other|one"})
        assert busy.status_code == 503 and busy.json()["error"]["type"] == "server_busy"
        assert complete().status_code == 200
        release.set()
        assert held.result().status_code == 200 and held.result().json()["choices"][0]["text"] in ("held", "back")
    assert complete(structured_outputs={"regex": "other|one"}).status_code == 200
    wait_idle(engine)
