"""An OpenAI-compatible HTTP server over `AsyncLLMEngine` (FastAPI + uvicorn).

    python -m llm_runtime serve --port 8000           # the bundled model
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "SmolLM2-135M-Instruct", "prompt": "Hello", "max_tokens": 8}'

Routes: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions` (the tokenizer's
chat template; content a string or a list of text parts), `GET /health`, `GET /metrics`
(Prometheus), `GET /v1/kv_transfer` (a server started with `--kv-transfer-config`: its role, and where it
receives KV blocks; a request's `kv_transfer_params` then say what to do with its KV, serving/kv_agent.py),
`POST /reset_prefix_cache` (vLLM's: forget the cached blocks no request holds; with `--enable-dev-routes` only, as
vLLM serves it in development mode), `GET /v1/engine/events` (the
engine's live state as server-sent events, engine_events.py) and `GET /dashboard` (a page that draws them:
the batch of every step, the KV pool block by block, each request's timeline). Constrained output (lesson 15): `structured_outputs` (vLLM's: json, regex, choice,
grammar) on both completions routes, `response_format` (json_schema, json_object) and `tools` with a
`tool_choice` naming a function or "required" on chat (`tools.py`; "auto" needs a tool-call parser this
model lacks and is refused). Responses carry OpenAI's fields, `usage` and `logprobs` included; `stream: true`
sends one server-sent event per generated token (even when its text is still incomplete), ending
with `data: [DONE]`. Every failure is OpenAI's JSON error object: 400 for an invalid request (its
`param` names the field), 404 for an unknown model or route, 413 for a body over the limit, 500 when
the engine failed this request (mid-stream: an `error` event before `[DONE]`), 503 when the queue is
full, too many distinct constraints are compiling (or one waited 30 s for a compiler), or the engine loop
stopped. A client that hangs up, streaming or not, has its request aborted.
The OpenAPI schema (`/openapi.json`) documents exactly this, with the engine's limits as bounds.
With `--api-key` (or LLM_RUNTIME_API_KEY), every `/v1` route wants it as a bearer token (401 without it,
middleware.py). The server binds 127.0.0.1 unless told otherwise (`--host`); the README's security section says
what is exposed and how to lock it down.
"""


import asyncio
import contextlib
import functools
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.engine import LLMEngine
from ..errors import EngineBusyError, EngineDeadError, InvalidRequestError
from .kv_agent import KVTransferAgent
from ..kv_transfer.config import KVTransferConfig
from ..sampling import SamplingParams
from . import event_protocol, protocol
from .async_engine import AsyncLLMEngine, RequestStream
from .dashboard import STATIC_DIR
from .engine_events import EngineFeed
from .metrics import ServerMetrics
from .middleware import ApiKeyCheck, BodyLimit, RedactApiKey
from .responses import APIError, Formatter, OpenAIResponse
from .tools import ChatConstraint, chat_constraint

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BYTES = 2 * 2**20  # 2 MiB: hundreds of full-context prompts, not a denial of service
DEV_ROUTES = ("/reset_prefix_cache",)  # served with enable_dev_routes only; behind the API key when there is one
EVENTS_KEEPALIVE_S = 15.0  # an idle event stream sends a comment this often (a client that left is noticed)


# ------------------------------------------------------------------------------------------ errors
def _validation_error(error: RequestValidationError) -> APIError:
    first = error.errors()[0]
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first.get('msg')}")
    field = ".".join(location) or "body"
    return APIError(400, f"{field}: {first.get('msg')}", param=location[0] if location else None)


# ------------------------------------------------------------------------------------------ the schema
_ERROR_STATUSES = {400: "invalid request (`param` names the field)", 404: "unknown model", 413: "body too large",
                   500: "the engine failed this request",
                   503: "queue full, too many constraints compiling, or the engine loop stopped"}
_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": protocol.ErrorResponse, "description": text} for status, text in _ERROR_STATUSES.items()}


def _sse_doc(chunk: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """The 200 response of a route that streams `chunk`s as server-sent events when `stream` is true."""
    json_data = {"type": "string", "contentMediaType": "application/json", "contentSchema": {"anyOf": [
        {"$ref": f"#/components/schemas/{chunk.__name__}"}, {"$ref": "#/components/schemas/ErrorResponse"}]}}
    event = {"type": "object", "required": ["data"], "properties": {
        "data": {"anyOf": [json_data, {"type": "string", "const": "[DONE]"}],
                 "description": f"a {chunk.__name__} as JSON (an error object if the request failed), then [DONE]"},
        "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer", "minimum": 0}}}
    return {200: {"description": f"the response; with `stream: true`, server-sent events of {chunk.__name__}",
                  "content": {"text/event-stream": {"schema": event}}}}


def _events_doc() -> dict[int | str, dict[str, Any]]:
    """The 200 response of `/v1/engine/events`: server-sent events named by their type, `data` an EngineHello first and
    EngineStates after it."""
    json_data = {"type": "string", "contentMediaType": "application/json", "contentSchema": {"anyOf": [
        {"$ref": "#/components/schemas/EngineHello"}, {"$ref": "#/components/schemas/EngineState"}]}}
    event = {"type": "object", "required": ["data"], "properties": {
        "data": json_data, "event": {"type": "string", "enum": ["hello", "state"]}, "id": {"type": "string"},
        "retry": {"type": "integer", "minimum": 0}}}
    return {200: {"description": "server-sent events: a hello, then the engine's state between steps (an "
                                 "EngineEvent's `event` in each `data`)",
                  "content": {"text/event-stream": {"schema": event}}}}


def _openapi(app: FastAPI, request_models: tuple[type[BaseModel], ...]) -> dict[str, Any]:
    """FastAPI's schema, made to tell the truth: validation errors are 400 (never 422), the streamed
    chunk models are components, and request bodies are their models' own JSON schema (FastAPI's
    OpenAPI model turns integer bounds into floats: 2**63 - 1 would become 2**63)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes, description=app.description)
        for path in schema["paths"].values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        for model in (*request_models, protocol.CompletionChunk, protocol.ChatCompletionChunk, event_protocol.EngineHello,
                      event_protocol.EngineState):
            definition = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(definition.pop("$defs", {}))
            components[model.__name__] = definition
        app.openapi_schema = schema
    return app.openapi_schema


# ------------------------------------------------------------------------------------------ the app
def create_app(engine: LLMEngine, model_name: str, max_waiting_requests: int = 256,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               step_executor: ThreadPoolExecutor | None = None,
               kv_transfer_config: KVTransferConfig | None = None, api_key: str | None = None,
               enable_dev_routes: bool = False) -> FastAPI:
    """The FastAPI app; the engine loop starts and stops with it. `step_executor`: the thread that built
    the engine, to step on (async_engine.py says why). `kv_transfer_config`: this server's part in
    disaggregated prefill and decode (kv_transfer/, lesson 18). `api_key`: what every `/v1` route (and the
    development routes) wants as a bearer token (middleware.py). `enable_dev_routes`: serve the routes that change
    the server's state for a measurement (`POST /reset_prefix_cache`), which vLLM serves in development mode only."""
    # The receiver's thread wakes the loop when blocks arrive, so an idle server takes them in (and expires them).
    agent = KVTransferAgent(engine, kv_transfer_config, on_message=lambda: async_engine.wake()) \
        if kv_transfer_config is not None else None
    async_engine = AsyncLLMEngine(engine, max_waiting_requests, step_executor=step_executor, kv_transfer=agent,
                                  feed=EngineFeed(engine, model_name))
    metrics = ServerMetrics(async_engine)
    config = engine.config
    limits = protocol.EngineLimits(engine.model.config.vocab_size, engine.max_model_len, config.max_num_seqs,
                                   config.max_logprobs, config.max_num_stop_strings, config.max_stop_string_len)
    CompletionRequest, ChatCompletionRequest = protocol.bounded_request_models(limits)
    formatter = Formatter(engine, model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await async_engine.start()
        try:
            yield
        finally:
            try:
                await async_engine.stop()
            finally:
                if agent is not None:
                    agent.close()

    app = FastAPI(title="llm_runtime", version="0.1.0", lifespan=lifespan,
                  description="An OpenAI-compatible server for one model (see the llm_runtime course).")
    app.add_middleware(BodyLimit, limit=max_request_bytes)
    if api_key is not None:  # outermost: a request without the key is refused before its body is read
        app.add_middleware(ApiKeyCheck, api_key=api_key, paths=DEV_ROUTES)
    app.openapi = functools.partial(_openapi, app, (CompletionRequest, ChatCompletionRequest))  # type: ignore[method-assign]
    app.state.async_engine = async_engine

    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        return _validation_error(error).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return APIError(error.status_code, str(error.detail), kind=kind, headers=error.headers).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:
        logger.exception("unexpected error answering %s", request.url.path)
        return APIError(500, f"internal server error: {type(error).__name__}", kind="server_error").response()

    @app.get("/health", response_model=protocol.Health, responses={503: _ERRORS[503]})
    async def health() -> protocol.Health:
        if not async_engine.is_running:
            raise APIError(503, f"the engine loop stopped: {async_engine.error!r}", kind="server_error")
        return protocol.Health(status="ok")

    @app.get("/metrics", response_class=Response, responses={200: {
        "description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/kv_transfer", response_model=protocol.KVTransferInfo, responses={404: _ERRORS[404]})
    async def kv_transfer() -> protocol.KVTransferInfo:
        """This server's part in KV transfer, and where a consumer receives blocks (what a router asks)."""
        if agent is None:
            raise APIError(404, "this server takes no part in KV transfer", kind="not_found_error")
        address = agent.address
        return protocol.KVTransferInfo(kv_role=agent.config.kv_role, kv_connector=agent.config.kv_connector,
                                       kv_ip=address[0] if address else None, kv_port=address[1] if address else None)

    if enable_dev_routes:
        @app.post("/reset_prefix_cache", response_model=protocol.PrefixCacheReset, responses={503: _ERRORS[503]})
        async def reset_prefix_cache() -> protocol.PrefixCacheReset:
            """Forget every cached block no request holds, as vLLM's route of this name: for a measurement that
            must start from a cold cache (lesson 18). Served only with `--enable-dev-routes`."""
            try:
                return protocol.PrefixCacheReset(freed_blocks=await async_engine.reset_prefix_cache())
            except EngineDeadError as error:
                raise APIError(503, str(error), kind="server_error") from error

    @app.get("/v1/engine/events", response_class=StreamingResponse, responses={**_events_doc(), 503: _ERRORS[503]})
    async def engine_events(request: Request) -> StreamingResponse:
        """The engine's live state (engine_events.py): a hello, then a state event at most every `interval_ms` while
        the engine works. A subscriber that does not keep up is dropped (its stream ends; EventSource reconnects)."""
        if not async_engine.is_running:
            raise APIError(503, f"the engine loop stopped: {async_engine.error!r}", kind="server_error")
        feed = async_engine.feed
        if feed.is_full:
            raise APIError(503, f"{feed.max_subscribers} live views are open already; retry later", kind="server_busy")
        return StreamingResponse(_event_stream(async_engine), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.get("/dashboard", response_class=FileResponse, responses={200: {
        "description": "the live dashboard (HTML)", "content": {"text/html": {"schema": {"type": "string"}}}}})
    async def dashboard() -> FileResponse:
        """A page that draws `/v1/engine/events`: open it in a browser while the server works."""
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html")

    app.mount("/dashboard/static", StaticFiles(directory=STATIC_DIR), name="dashboard-static")

    @app.get("/v1/models", response_model=protocol.ModelList)
    async def models() -> protocol.ModelList:
        return protocol.ModelList(data=[protocol.ModelCard(id=model_name, max_model_len=engine.max_model_len)])

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{model_name}`",
                           param="model", code="model_not_found")

    async def start(add: Callable[[], Awaitable[list[RequestStream]]], field_names: dict[str, str]
                    ) -> list[RequestStream]:
        try:
            return await add()
        except EngineBusyError as error:
            raise APIError(503, str(error), kind="server_busy") from error
        except EngineDeadError as error:
            raise APIError(503, str(error), kind="server_error") from error
        except InvalidRequestError as error:
            raise _refused(error, field_names) from error

    def sampling_params(body: protocol._SamplingFields, field_names: dict[str, str], **kwargs: Any) -> SamplingParams:
        try:
            return body.sampling_params(**kwargs)
        except InvalidRequestError as error:
            raise _refused(error, field_names) from error

    def constraint_of(body: Any) -> ChatConstraint:
        try:
            return chat_constraint(body)
        except InvalidRequestError as error:
            raise _refused(error, {}) from error

    @app.post("/v1/completions", response_model=protocol.CompletionResponse,
              responses={**_sse_doc(protocol.CompletionChunk), **_ERRORS})
    async def completions(body: CompletionRequest, request: Request) -> Any:  # type: ignore[valid-type]
        # (this module has no `from __future__ import annotations`: FastAPI must see the classes made above)
        check_model(body.model)
        prompts: list[str | list[int]]
        if isinstance(body.prompt, str) or (body.prompt and isinstance(body.prompt[0], int)):
            prompts = [body.prompt]
        else:
            prompts = list(body.prompt)
        if not prompts:
            raise APIError(400, "prompt: give at least one prompt", param="prompt")
        params = sampling_params(body, {}, max_tokens=body.max_tokens, logprobs=body.logprobs,
                                 prompt_logprobs=body.prompt_logprobs)
        streams = await start(lambda: async_engine.add_requests(prompts, params,
                                                                kv_transfer_params=body.kv_transfer_params), {})
        return await respond(streams, body, request, chat=False, num_top=body.logprobs or 0)

    chat_fields = {"logprobs": "top_logprobs", "max_tokens": "max_completion_tokens", "prompt": "messages"}

    @app.post("/v1/chat/completions", response_model=protocol.ChatCompletionResponse,
              responses={**_sse_doc(protocol.ChatCompletionChunk), **_ERRORS})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:  # type: ignore[valid-type]
        check_model(body.model)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        constraint = constraint_of(body)
        fields = {**chat_fields, **constraint.field_names}
        params = sampling_params(body, fields, max_tokens=max_tokens, logprobs=logprobs,
                                 structured=constraint.structured)
        streams = await start(lambda: _as_list(async_engine.add_chat(
            constraint.messages, params, kv_transfer_params=body.kv_transfer_params)), fields)
        return await respond(streams, body, request, chat=True, num_top=body.top_logprobs or 0, constraint=constraint)

    async def respond(streams: list[RequestStream], body: protocol._SamplingFields, request: Request,
                      chat: bool, num_top: int, constraint: ChatConstraint | None = None) -> Any:
        response = OpenAIResponse(formatter, body.n, chat, num_top, constraint)
        if body.stream:
            return StreamingResponse(sse_events(response.stream(streams, metrics, body.include_usage_in_stream)),
                                     media_type="text/event-stream")
        finals = await _until_done_or_gone(response.collect(streams, metrics), request, streams)
        if finals is None:
            return Response(status_code=499)  # nobody is listening; the requests were aborted
        return JSONResponse(finals)

    return app


def _refused(error: InvalidRequestError, field_names: dict[str, str]) -> APIError:
    """A 400 naming the field at fault, as this route calls it (chat says top_logprobs for logprobs)."""
    return APIError(400, str(error), param=field_names.get(error.param or "", error.param))


async def _as_list(stream: Awaitable[RequestStream]) -> list[RequestStream]:
    return [await stream]


async def _until_done_or_gone(work: Awaitable[dict], request: Request, streams: list[RequestStream]) -> dict | None:
    """The response, or None if the client hung up first (its requests are aborted then)."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    working, watching = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({working, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
        if not working.done():  # the client left (or this handler was cancelled): stop its requests
            working.cancel()
            for stream in streams:
                stream.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await working
    return None if working.cancelled() else working.result()


async def _event_stream(async_engine: AsyncLLMEngine) -> AsyncIterator[str]:
    """A subscription as server-sent events (`event:` names the type); a comment when idle. It subscribes when the
    response starts (a client gone before then leaves nothing behind) and unsubscribes at the end."""
    feed = async_engine.feed
    subscription = async_engine.subscribe_events()
    try:
        yield "retry: 1000\n\n"  # a dropped page's EventSource comes back after a second
        events = aiter(subscription)
        while True:
            try:
                event = await asyncio.wait_for(anext(events), EVENTS_KEEPALIVE_S)
            except asyncio.TimeoutError:
                yield ": keepalive\n\n"
                continue
            except StopAsyncIteration:  # dropped for falling behind, or the engine stopped
                return
            yield f"event: {event['type']}\ndata: {feed.encode(event)}\n\n"
    finally:
        feed.unsubscribe(subscription)


def sse_events(events: AsyncIterator[dict]) -> AsyncIterator[str]:
    """Server-sent events; a failure mid-stream becomes an error event, and [DONE] always ends it."""

    async def encode() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield f"data: {json.dumps(event)}\n\n"
        except APIError as error:
            yield f"data: {json.dumps(protocol.ErrorResponse(error=error.info).model_dump())}\n\n"
        except Exception as error:
            logger.exception("a stream failed")
            info = protocol.ErrorInfo(message=f"internal server error: {type(error).__name__}", type="server_error")
            yield f"data: {json.dumps(protocol.ErrorResponse(error=info).model_dump())}\n\n"
        yield "data: [DONE]\n\n"

    return encode()


class Server(uvicorn.Server):
    """uvicorn's server, which ends the app's event streams as soon as it is told to stop. uvicorn lets every open
    response finish before it stops, and an event stream never finishes by itself: it would hold a SIGTERM up for
    as long as a page stays open. Completions in flight still finish."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self.on_exit = on_exit

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        try:  # a signal handler runs between two bytecodes of the loop's thread: close on the loop, not here
            asyncio.get_running_loop().call_soon_threadsafe(self.on_exit)
        except RuntimeError:  # no loop running: nothing to interrupt
            self.on_exit()
        super().handle_exit(sig, frame)


def serve(engine: LLMEngine, model_name: str, host: str = "127.0.0.1", port: int = 8000,
          max_waiting_requests: int = 256, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
          step_executor: ThreadPoolExecutor | None = None, kv_transfer_config: KVTransferConfig | None = None,
          api_key: str | None = None, enable_dev_routes: bool = False) -> None:
    app = create_app(engine, model_name, max_waiting_requests, max_request_bytes, step_executor, kv_transfer_config,
                     api_key, enable_dev_routes)
    logging.getLogger("uvicorn.access").addFilter(RedactApiKey())  # the feed's ?api_key= stays out of the log
    Server(uvicorn.Config(app, host=host, port=port, log_level="info"), on_exit=app.state.async_engine.feed.close).run()
