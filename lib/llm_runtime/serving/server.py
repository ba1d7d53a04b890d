"""An OpenAI-compatible HTTP server over `AsyncLLMEngine` (FastAPI + uvicorn).

    python -m llm_runtime serve --port 8000           # the bundled model
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "SmolLM2-135M-Instruct", "prompt": "Hello", "max_tokens": 8}'

Routes: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions` (the tokenizer's
chat template), `GET /health`, `GET /metrics` (Prometheus text). Responses carry OpenAI's fields,
`usage` included; `stream: true` sends server-sent events ending with `data: [DONE]`. Errors are
OpenAI's JSON error object: 400 for invalid parameters (the message names the field), 404 for an
unknown model, 503 when the queue is full. A dropped streaming connection aborts its request.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from ..engine.engine import LLMEngine
from ..engine.outputs import RequestOutput
from ..model.tokenizer import encode_chat
from ..sampling import SamplingParams
from .async_engine import AsyncLLMEngine, EngineBusyError, RequestStream


# ------------------------------------------------------------------------------------ request bodies
class _SamplingFields(BaseModel):
    """OpenAI's sampling fields and vLLM's extra ones; unknown fields are refused by name."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None
    # vLLM's extensions, passed straight to SamplingParams
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, seed=self.seed,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos, max_tokens=max_tokens,
            min_tokens=self.min_tokens, logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output)

    @property
    def include_usage_in_stream(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: Literal[False] = False
    suffix: None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


# ------------------------------------------------------------------------------------------ errors
class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


def _validation_error(error: RequestValidationError) -> APIError:
    first = error.errors()[0]
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first.get('msg')}")
    field = ".".join(location) or "body"
    return APIError(400, f"{field}: {first.get('msg')}", param=location[0] if location else None)


# ----------------------------------------------------------------------------------------- metrics
class Histogram:
    """A Prometheus histogram: cumulative bucket counts, sum and count."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.total += value
        self.count += 1

    def render(self, name: str, help_text: str) -> list[str]:
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        lines += [f'{name}_bucket{{le="{bound}"}} {count}' for bound, count in zip(self.buckets, self.counts)]
        lines += [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.total}", f"{name}_count {self.count}"]
        return lines


class ServerMetrics:
    """Counters the server keeps beside the engine's own stats."""

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished_requests = 0
        self.ttft = Histogram((0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0))
        self.itl = Histogram((0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5))

    def record(self, output: RequestOutput) -> None:
        self.finished_requests += 1
        self.prompt_tokens += len(output.prompt_token_ids)
        self.generation_tokens += sum(len(c.token_ids) for c in output.outputs)
        metrics = output.metrics
        if metrics is not None and metrics.first_token_time is not None:
            self.ttft.observe(metrics.first_token_time - metrics.arrival_time)
            for a, b in zip(metrics.token_times, metrics.token_times[1:]):
                self.itl.observe(b - a)

    def render(self, engine: AsyncLLMEngine) -> str:
        stats = engine.engine.stats()
        gauges = [
            ("llm_runtime_num_requests_running", "sequences running", stats.num_running),
            ("llm_runtime_num_requests_waiting", "sequences waiting", engine.num_waiting),
            ("llm_runtime_kv_blocks_used", "KV blocks in use", stats.num_used_blocks),
            ("llm_runtime_kv_blocks_total", "KV blocks in the pool", stats.num_total_blocks),
            ("llm_runtime_prefix_cache_hit_rate", "prompt tokens found in the prefix cache / looked up",
             stats.prefix_cache_hit_rate),
        ]
        counters = [
            ("llm_runtime_prompt_tokens_total", "prompt tokens of finished requests", self.prompt_tokens),
            ("llm_runtime_generation_tokens_total", "tokens generated by finished requests", self.generation_tokens),
            ("llm_runtime_requests_finished_total", "requests finished", self.finished_requests),
            ("llm_runtime_requests_aborted_total", "requests cancelled before they finished", engine.num_aborted),
            ("llm_runtime_preemptions_total", "sequences preempted", stats.num_preemptions),
        ]
        lines = []
        for kind, rows in (("gauge", gauges), ("counter", counters)):
            for name, help_text, value in rows:
                lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value}"]
        lines += self.ttft.render("llm_runtime_time_to_first_token_seconds", "time to first token")
        lines += self.itl.render("llm_runtime_inter_token_latency_seconds", "time between consecutive tokens")
        return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------- app
def create_app(engine: LLMEngine, model_name: str, max_waiting_requests: int = 256) -> FastAPI:
    """The FastAPI app; the engine loop starts and stops with it."""
    async_engine = AsyncLLMEngine(engine, max_waiting_requests)
    metrics = ServerMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await async_engine.start()
        try:
            yield
        finally:
            await async_engine.stop()

    app = FastAPI(title="llm_runtime", lifespan=lifespan)
    app.state.async_engine = async_engine

    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        return _validation_error(error).response()

    @app.get("/health")
    async def health() -> JSONResponse:
        if not async_engine.is_running:
            raise APIError(503, f"the engine loop stopped: {async_engine.error!r}", kind="server_error")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(async_engine), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [
            {"id": model_name, "object": "model", "created": 0, "owned_by": "llm_runtime",
             "max_model_len": engine.max_model_len}]})

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{model_name}`",
                           param="model", code="model_not_found")

    async def start(prompt: str | list[int], params: SamplingParams) -> RequestStream:
        try:
            return await async_engine.add_request(prompt, params)
        except EngineBusyError as error:
            raise APIError(503, str(error), kind="server_busy") from error
        except ValueError as error:
            raise APIError(400, str(error)) from error

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> Any:
        check_model(body.model)
        prompts: list[str | list[int]]
        if isinstance(body.prompt, str) or (body.prompt and isinstance(body.prompt[0], int)):
            prompts = [body.prompt]  # type: ignore[list-item]
        else:
            prompts = list(body.prompt)  # type: ignore[arg-type]
        if not prompts:
            raise APIError(400, "prompt: give at least one prompt", param="prompt")
        params = _params(body, body.max_tokens, body.logprobs)
        streams = [await start(p, params) for p in prompts]
        response = _Response("cmpl", "text_completion", model_name, body.n, chat=False)
        if body.stream:
            return _sse(response.stream(streams, metrics, body.include_usage_in_stream))
        return JSONResponse(await response.collect(streams, metrics))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest) -> Any:
        check_model(body.model)
        if engine.tokenizer is None:
            raise APIError(400, "this server's model has no tokenizer for chat")
        try:
            prompt = encode_chat(engine.tokenizer, [m.model_dump() for m in body.messages])
        except ValueError as error:
            raise APIError(400, str(error), param="messages") from error
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        streams = [await start({"prompt_token_ids": prompt}, _params(body, max_tokens, logprobs))]  # type: ignore[arg-type]
        response = _Response("chatcmpl", "chat.completion", model_name, body.n, chat=True)
        if body.stream:
            return _sse(response.stream(streams, metrics, body.include_usage_in_stream))
        return JSONResponse(await response.collect(streams, metrics))

    return app


def _params(body: _SamplingFields, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    try:
        return body.sampling_params(max_tokens, logprobs)
    except ValueError as error:
        first_word = str(error).split(" ", 1)[0]  # SamplingParams' messages start with the field's name
        raise APIError(400, str(error), param=first_word if first_word in type(body).model_fields else None) from error


def _sse(events: AsyncIterator[dict]) -> StreamingResponse:
    async def encode() -> AsyncIterator[str]:
        async for event in events:
            yield f"data: {json.dumps(event)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(encode(), media_type="text/event-stream")


class _Response:
    """Builds OpenAI's completion / chat completion objects from the engine's outputs."""

    def __init__(self, prefix: str, kind: str, model: str, n: int, chat: bool) -> None:
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.kind, self.model, self.n, self.chat = kind, model, n, chat
        self.created = int(time.time())

    def _envelope(self, kind: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def _choice(self, index: int, text: str, finish_reason: str | None, delta: bool) -> dict:
        if not self.chat:
            return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
        content = {"content": text} if delta else {"role": "assistant", "content": text}
        return {"index": index, "delta" if delta else "message": content, "logprobs": None,
                "finish_reason": finish_reason}

    @staticmethod
    def _usage(finals: list[RequestOutput]) -> dict:
        prompt = sum(len(o.prompt_token_ids) for o in finals)
        completion = sum(len(c.token_ids) for o in finals for c in o.outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    async def collect(self, streams: list[RequestStream], metrics: ServerMetrics) -> dict:
        finals = []
        try:
            for stream in streams:
                final = None
                async for output in stream:
                    final = output
                assert final is not None
                metrics.record(final)
                finals.append(final)
        finally:
            for stream in streams:
                stream.cancel()
        choices = [self._choice(p * self.n + c.index, c.text, c.finish_reason, delta=False)
                   for p, final in enumerate(finals) for c in final.outputs]
        return {**self._envelope(self.kind, choices), "usage": self._usage(finals)}

    async def stream(self, streams: list[RequestStream], metrics: ServerMetrics,
                     include_usage: bool) -> AsyncIterator[dict]:
        kind = f"{self.kind}.chunk" if self.chat else self.kind
        finals = []
        try:
            if self.chat:  # OpenAI's first chat chunk carries the role
                yield self._envelope(kind, [{"index": i, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None} for i in range(self.n)])
            for p, stream in enumerate(streams):
                async for output in stream:
                    choices = [self._choice(p * self.n + c.index, c.text_delta, c.finish_reason, delta=True)
                               for c in output.outputs if c.text_delta or c.finish_reason]
                    if choices:
                        yield self._envelope(kind, choices)
                    if output.finished:
                        metrics.record(output)
                        finals.append(output)
            if include_usage:
                yield {**self._envelope(kind, []), "usage": self._usage(finals)}
        finally:  # the client went away (or we are done): stop whatever still runs
            for stream in streams:
                stream.cancel()


def serve(engine: LLMEngine, model_name: str, host: str = "127.0.0.1", port: int = 8000,
          max_waiting_requests: int = 256) -> None:
    import uvicorn

    uvicorn.run(create_app(engine, model_name, max_waiting_requests), host=host, port=port, log_level="info")
