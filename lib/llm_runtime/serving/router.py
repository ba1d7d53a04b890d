"""`python -m llm_runtime router`: an OpenAI-compatible front for several servers (lesson 18).

    router --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200          # disaggregated
    router --replica http://127.0.0.1:8100 http://127.0.0.1:8101 --policy cache_aware  # data-parallel replicas

Disaggregated (`--prefill` and `--decode`, each one or more servers started with `--kv-transfer-config`): each
request goes first to a prefill server with one token to generate and `kv_transfer_params` that tell it to ship
the prompt's KV blocks to the chosen decode server (its receiving address, from `GET /v1/kv_transfer`), then to
that decode server, whose answer, streamed or not, is the client's (vLLM's disaggregation proxy works the same
way). Replicas (`--replica`): each request goes to one server, by `--policy`:

- `round_robin`: in turn;
- `least_loaded`: the one with the fewest requests in flight through this router;
- `cache_aware`: the one whose prefix cache most likely holds the longest prefix of this prompt. The router keeps,
  per replica, the chained hashes of the prompts it sent there, cut every `CHUNK` characters (an approximate
  view of the replica's cache, as SGLang's router keeps an approximate radix tree); a prompt goes where the
  longest run of its chunks was sent before, when that covers at least `MIN_MATCH` of it, else to the least
  loaded replica (a prompt no replica has seen spreads the load).

Health: every backend's `/health` is polled; one that fails it, or refuses a connection, leaves the rotation
until it answers again, and the requests in flight to it end at once with a 502 (a prefill is tried again on
another healthy prefill server first: it has no effect a client sees). With no healthy backend of a
kind a request needs, the answer is 503. A client that disconnects closes the router's connection to the backend,
which aborts the request there. `/metrics` counts requests and errors per backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import logging
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Container, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest

logger = logging.getLogger(__name__)

POLICIES = ("round_robin", "least_loaded", "cache_aware")
CHUNK = 64  # characters per hashed chunk of a prompt (cache_aware)
MIN_MATCH = 0.5  # the share of a prompt a replica must have seen for cache_aware to prefer it over the least loaded
MAX_REMEMBERED = 50_000  # chunk hashes remembered per replica, least recently used forgotten first
HEALTH_INTERVAL_S = 1.0
WENT_DOWN = "the backend went down"  # the message of a cancellation by mark_down (any other is passed on)


def _error(status: int, message: str, kind: str = "server_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}}, status_code=status)


@dataclass(eq=False)
class Backend:
    """One server behind the router: its URL, whether it answers, and what this router has in flight there."""

    url: str
    role: str  # "prefill", "decode" or "replica"
    healthy: bool = True
    in_flight: int = 0
    kv_address: tuple[str, int] | None = None  # a decode server's: where it receives KV blocks
    tasks: set[asyncio.Task] = field(default_factory=set)  # requests in flight (cancelled if it goes down)
    remembered: OrderedDict[bytes, None] = field(default_factory=OrderedDict)  # cache_aware's chunk hashes


def prompt_text(body: dict[str, Any]) -> str:
    """What a request's prompt is, as text the router can compare: the completion prompt, or the chat messages."""
    if "messages" in body:
        return json.dumps(body["messages"], sort_keys=True, ensure_ascii=False)
    return json.dumps(body.get("prompt"), ensure_ascii=False)


def chunk_hashes(text: str) -> list[bytes]:
    """Chained hashes of `text`'s whole CHUNK-character chunks: equal lists mean equal prefixes."""
    hashes, parent = [], b""
    for start in range(0, len(text) - CHUNK + 1, CHUNK):
        parent = hashlib.blake2b(parent + text[start : start + CHUNK].encode(), digest_size=16).digest()
        hashes.append(parent)
    return hashes


def cache_aware_choice(hashes: Sequence[bytes], remembered: Sequence[Container[bytes]], in_flight: Sequence[int],
                       min_match: float = MIN_MATCH) -> int:
    """Which replica gets a prompt of these chained chunk hashes: the one that was sent the longest run of them
    (its first k hashes, for the largest k), when that run is at least one chunk and at least `min_match` of the
    prompt's chunks; otherwise the least loaded. Ties go to the first replica."""
    least = min(range(len(in_flight)), key=in_flight.__getitem__)
    best, best_match = least, 0
    for index, seen in enumerate(remembered):
        match = next((i for i, h in enumerate(hashes) if h not in seen), len(hashes))
        if match > best_match:
            best, best_match = index, match
    return best if best_match > 0 and best_match >= min_match * len(hashes) else least


class Pool:
    """The backends of one kind, and how the next one is chosen."""

    def __init__(self, backends: list[Backend], policy: str) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.backends, self.policy = backends, policy
        self._turn = itertools.count()

    def healthy(self) -> list[Backend]:
        return [b for b in self.backends if b.healthy]

    def choose(self, text: str, exclude: Container[Backend] = ()) -> Backend | None:
        """The backend for a prompt, not one of `exclude` (None: no other is healthy); cache_aware remembers where
        the prompt went."""
        candidates = [b for b in self.healthy() if b not in exclude]
        if not candidates:
            return None
        if self.policy == "round_robin":
            return candidates[next(self._turn) % len(candidates)]
        if self.policy == "least_loaded":
            return min(candidates, key=lambda b: b.in_flight)
        hashes = chunk_hashes(text)
        chosen = candidates[cache_aware_choice(hashes, [b.remembered for b in candidates],
                                               [b.in_flight for b in candidates])]
        for h in reversed(hashes):  # a prompt's first chunk most recent: forgotten last (a match starts with it)
            chosen.remembered[h] = None
            chosen.remembered.move_to_end(h)
        while len(chosen.remembered) > MAX_REMEMBERED:
            chosen.remembered.popitem(last=False)
        return chosen


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("llm_runtime_router_requests", "requests sent to a backend", ["backend", "role"],
                                registry=self.registry)
        self.errors = Counter("llm_runtime_router_errors", "requests a backend failed (connection, 5xx, timeout)",
                              ["backend", "role"], registry=self.registry)
        self.unavailable = Counter("llm_runtime_router_unavailable", "requests answered 503: no healthy backend",
                                   registry=self.registry)


class BackendFailed(Exception):
    """A backend could not be reached or answered with a server error."""

    def __init__(self, backend: Backend, message: str) -> None:
        super().__init__(message)
        self.backend = backend


def create_router(prefill: list[str] = (), decode: list[str] = (), replicas: list[str] = (),
                  policy: str = "round_robin", request_timeout_s: float = 600.0) -> FastAPI:
    """The router's app (module docstring): `prefill` and `decode` URLs together, or `replicas`."""
    if bool(prefill) != bool(decode):
        raise ValueError("disaggregated serving needs both --prefill and --decode servers")
    if bool(prefill) == bool(replicas):
        raise ValueError("give --prefill and --decode servers, or --replica servers (not both)")
    prefill_pool = Pool([Backend(u.rstrip("/"), "prefill") for u in prefill], policy)
    decode_pool = Pool([Backend(u.rstrip("/"), "decode") for u in decode], policy)
    replica_pool = Pool([Backend(u.rstrip("/"), "replica") for u in replicas], policy)
    everyone = prefill_pool.backends + decode_pool.backends + replica_pool.backends
    metrics = RouterMetrics()
    timeout = httpx.Timeout(request_timeout_s, connect=2.0)
    state: dict[str, Any] = {}

    async def check(backend: Backend) -> None:
        client: httpx.AsyncClient = state["client"]
        try:
            healthy = (await client.get(f"{backend.url}/health", timeout=2.0)).status_code == 200
            if healthy and backend.role == "decode" and backend.kv_address is None:
                info = (await client.get(f"{backend.url}/v1/kv_transfer", timeout=2.0)).json()
                backend.kv_address = (info["kv_ip"], info["kv_port"]) if info.get("kv_port") else None
                healthy = backend.kv_address is not None
        except (httpx.HTTPError, ValueError, KeyError):
            healthy = False
        if backend.healthy and not healthy:
            mark_down(backend, "it failed its health check")
        backend.healthy = healthy

    def mark_down(backend: Backend, why: str) -> None:
        if backend.healthy:
            logger.warning("backend %s is out of rotation: %s", backend.url, why)
        backend.healthy = False
        for task in list(backend.tasks):  # nothing waits on a server that is gone
            task.cancel(msg=WENT_DOWN)

    async def watch() -> None:
        while True:
            await asyncio.gather(*(check(b) for b in everyone))
            await asyncio.sleep(HEALTH_INTERVAL_S)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state["client"] = httpx.AsyncClient(timeout=timeout)
        await asyncio.gather(*(check(b) for b in everyone))
        watcher = asyncio.create_task(watch())
        try:
            yield
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            await state["client"].aclose()

    app = FastAPI(title="llm_runtime router", lifespan=lifespan)
    app.state.pools = {"prefill": prefill_pool, "decode": decode_pool, "replica": replica_pool}

    @app.get("/health")
    async def health() -> JSONResponse:
        pools = [prefill_pool, decode_pool] if prefill_pool.backends else [replica_pool]
        if all(pool.healthy() for pool in pools):
            return JSONResponse({"status": "ok"})
        return _error(503, "no healthy backend for some kind of request")

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> Response:
        pool = decode_pool if decode_pool.backends else replica_pool
        backend = pool.choose("")
        if backend is None:
            return _error(503, "no healthy backend")
        try:
            answer = await state["client"].get(f"{backend.url}/v1/models")
        except httpx.HTTPError as error:
            mark_down(backend, str(error))
            return _error(502, f"the backend {backend.url} failed: {error}")
        return Response(answer.content, status_code=answer.status_code, media_type="application/json")

    async def post(backend: Backend, path: str, body: dict[str, Any]) -> httpx.Response:
        """A whole response from a backend (a 5xx counted as an error); BackendFailed when none can be had: the
        connection failed or timed out, or the backend was taken out of rotation meanwhile."""
        metrics.requests.labels(backend.url, backend.role).inc()
        backend.in_flight += 1
        task = asyncio.current_task()
        assert task is not None
        backend.tasks.add(task)
        try:
            answer = await state["client"].post(f"{backend.url}{path}", json=body)
        except asyncio.CancelledError as error:
            if error.args != (WENT_DOWN,):  # the client left, or the router stops
                raise
            task.uncancel()
            raise BackendFailed(backend, f"the backend {backend.url} went down") from None
        except httpx.HTTPError as error:
            metrics.errors.labels(backend.url, backend.role).inc()
            backend.tasks.discard(task)  # its own failure: not cancelled by mark_down below
            if isinstance(error, (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError)):
                mark_down(backend, str(error))
            raise BackendFailed(backend, f"the backend {backend.url} failed: {type(error).__name__}: {error}") from error
        finally:
            backend.in_flight -= 1
            backend.tasks.discard(task)
        if answer.status_code >= 500 and answer.status_code != 503:
            metrics.errors.labels(backend.url, backend.role).inc()
        return answer

    async def relay(backend: Backend, path: str, body: dict[str, Any], request: Request) -> Response:
        """The backend's answer to the client: streamed through as it comes, or whole."""
        if not body.get("stream"):
            work = asyncio.create_task(post(backend, path, body))

            async def gone() -> None:
                while (await request.receive())["type"] != "http.disconnect":
                    pass

            watching = asyncio.create_task(gone())
            await asyncio.wait({work, watching}, return_when=asyncio.FIRST_COMPLETED)
            watching.cancel()
            if not work.done():  # the client left: closing our connection aborts the request upstream
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError, BackendFailed):
                    await work
                return Response(status_code=499)
            try:
                answer = work.result()
            except BackendFailed as error:
                return _error(502, str(error))
            return Response(answer.content, status_code=answer.status_code, media_type="application/json")
        return await stream(backend, path, body)

    async def stream(backend: Backend, path: str, body: dict[str, Any]) -> Response:
        client: httpx.AsyncClient = state["client"]
        metrics.requests.labels(backend.url, backend.role).inc()
        try:
            upstream = await client.send(client.build_request("POST", f"{backend.url}{path}", json=body), stream=True)
        except httpx.HTTPError as error:
            metrics.errors.labels(backend.url, backend.role).inc()
            mark_down(backend, str(error))
            return _error(502, f"the backend {backend.url} failed: {type(error).__name__}: {error}")
        if upstream.status_code != 200:
            content = await upstream.aread()
            await upstream.aclose()
            return Response(content, status_code=upstream.status_code, media_type="application/json")
        backend.in_flight += 1

        async def chunks() -> AsyncIterator[bytes]:
            task = asyncio.current_task()
            if task is not None:
                backend.tasks.add(task)
            failed = None
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            except httpx.HTTPError as error:  # the backend died mid-stream
                metrics.errors.labels(backend.url, backend.role).inc()
                if task is not None:
                    backend.tasks.discard(task)  # its own failure: not cancelled by mark_down below
                mark_down(backend, str(error))
                failed = f"the backend {backend.url} failed mid-stream"
            except asyncio.CancelledError as error:
                if error.args != (WENT_DOWN,):  # the client left, or the router stops
                    raise
                if task is not None:
                    task.uncancel()
                failed = f"the backend {backend.url} went down mid-stream"  # the health check took it out
            finally:  # also when the client left: closing the upstream aborts the request there
                backend.in_flight -= 1
                if task is not None:
                    backend.tasks.discard(task)
                await upstream.aclose()
            if failed is not None:  # an error event, then the end, as a server's own failed stream ends
                info = {"error": {"message": failed, "type": "server_error", "param": None, "code": None}}
                yield f"data: {json.dumps(info)}\n\ndata: [DONE]\n\n".encode()

        return StreamingResponse(chunks(), media_type="text/event-stream")

    async def route(path: str, request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the request body is not valid JSON", "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object", "invalid_request_error")
        text = prompt_text(body)
        if replica_pool.backends:
            backend = replica_pool.choose(text)
            if backend is None:
                metrics.unavailable.inc()
                return _error(503, "no healthy replica")
            return await relay(backend, path, body, request)
        if body.get("n", 1) != 1:
            return _error(400, "disaggregated serving runs one completion per request (n = 1)",
                          "invalid_request_error")
        decode_server = decode_pool.choose(text)
        if decode_server is None or decode_server.kv_address is None:
            metrics.unavailable.inc()
            return _error(503, "no healthy decode server")
        host, port = decode_server.kv_address
        # A prefill has no effect a client sees, so one whose server died is tried again on another healthy one
        # (under a new transfer id: blocks the dead one may have shipped expire unclaimed).
        failure: BackendFailed | None = None
        tried: list[Backend] = []
        for _ in range(len(prefill_pool.backends)):
            prefill_server = prefill_pool.choose(text, exclude=tried)
            if prefill_server is None:
                break
            tried.append(prefill_server)
            transfer_id = uuid.uuid4().hex
            first = {**body, "stream": False, "kv_transfer_params": {
                "do_remote_decode": True, "transfer_id": transfer_id, "remote_host": host, "remote_port": port}}
            first.pop("stream_options", None)
            first["max_completion_tokens" if "messages" in body else "max_tokens"] = 1
            first.pop("max_tokens" if "messages" in body else "max_completion_tokens", None)
            try:
                answer = await post(prefill_server, path, first)
            except BackendFailed as error:
                failure = error
                continue
            if answer.status_code != 200:  # the prefill server refused it (a 400 is the client's to see)
                return Response(answer.content, status_code=answer.status_code, media_type="application/json")
            rest = {**body, "kv_transfer_params": {"do_remote_prefill": True, "transfer_id": transfer_id}}
            return await relay(decode_server, path, rest, request)
        if failure is not None:
            return _error(502, str(failure))
        metrics.unavailable.inc()
        return _error(503, "no healthy prefill server")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await route("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await route("/v1/chat/completions", request)

    return app


def run_router(prefill: list[str], decode: list[str], replicas: list[str], policy: str, host: str, port: int) -> None:
    import uvicorn

    uvicorn.run(create_router(prefill, decode, replicas, policy), host=host, port=port, log_level="info")
