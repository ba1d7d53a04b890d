"""`python -m llm_runtime router`: an OpenAI-compatible front for several servers (lesson 18).

    router --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200          # disaggregated
    router --replica http://127.0.0.1:8100 http://127.0.0.1:8101 --policy cache_aware  # data-parallel replicas

Disaggregated (`--prefill` and `--decode`, each one or more servers started with `--kv-transfer-config`): each
request goes first to a prefill server with one token to generate and `kv_transfer_params` that tell it to ship
the prompt's KV blocks to the chosen decode server (its receiving address, from `GET /v1/kv_transfer`), then to
that decode server, whose answer, streamed or not, is the client's (vLLM's disaggregation proxy works the same
way). A completion request of several prompts (at most MAX_PROMPTS) is split into one pair of legs per prompt, run
at once, and their answers merged into one (choices in prompt order, usage summed; streamed, their events
interleaved as they come).
The prefill leg asks only for the prompt's KV: the client's sampling fields that shape the output (min_tokens,
logprobs, echo) are left to the decode leg. Replicas (`--replica`): each request goes to one server, by
`--policy`:

- `round_robin`: in turn;
- `least_loaded`: the one with the fewest requests in flight through this router;
- `cache_aware`: the one whose prefix cache most likely holds the longest prefix of this prompt. The router keeps,
  per replica, the chained hashes of the prompts it sent there, cut every `CHUNK` characters (an approximate
  view of the replica's cache, as SGLang's router keeps an approximate radix tree); a prompt goes where the
  longest run of its chunks was sent before, when that covers at least `MIN_MATCH` of it, else to the least
  loaded replica (a prompt no replica has seen spreads the load).

`kv_transfer_params` are the router's to set, never a client's: whatever a client sends under that name is
dropped, and with a KV secret (LLM_RUNTIME_KV_SECRET, shared with the servers: kv_transfer/trust.py) the router
signs the ones it sets, so the servers honour only those.

Health: every backend's `/health` is polled each second. A backend that refuses the connection is gone: it leaves
the rotation at once and the requests in flight to it end with a 502 (a prefill is tried again on another
healthy prefill server first: it has no effect a client sees). One that misses a probe (too slow to answer, or
not 200) stays in rotation until it has missed `MISSED_PROBES` in a row: a loaded server answers late, and its
requests in flight are left to finish. A decode server's receiving address is read again at every probe (a
restarted server may receive elsewhere; one bound to every interface is reached at its URL's host). With no
healthy backend of a kind a request needs, the answer is 503. A client that disconnects closes the router's
connection to the backend, which aborts the request there. `/metrics` counts requests and errors per backend.
Bodies are bounded (413 past `max_request_bytes`), and `--api-key` asks clients for a bearer token as `serve`'s
does (`--backend-api-key`: the one the router sends its backends, by default the same).

`Router` holds the health checks and the forwarding; how a backend is chosen is router_policy.py's, what is done
to bodies and streams (split, merged, relayed) router_streams.py's: each is tested on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest

from ..kv_transfer.trust import is_loopback, is_unspecified, sign_params
from .middleware import ApiKeyCheck, BodyLimit
from .router_policy import Backend, BackendFailed, Pool, prompt_text
from .router_streams import Refused, merge_answers, merged_events, split_prompts, unless_gone

logger = logging.getLogger(__name__)

HEALTH_INTERVAL_S = 1.0
HEALTH_TIMEOUT_S = 2.0
MISSED_PROBES = 3  # probes in a row a backend may miss (late, or not 200) before it leaves the rotation
DEFAULT_MAX_REQUEST_BYTES = 2 * 2**20
MAX_PROMPTS = 16  # prompts of one disaggregated completion request: each is a prefill and a shipped KV transfer
MERGED_EVENTS_QUEUED = 64  # events a merged stream holds for a slow reader before its legs wait
WENT_DOWN = "the backend went down"  # the message of a cancellation by mark_down (any other is passed on)
# What only shapes the output: the prefill leg, which generates one token to be thrown away, leaves these out.
OUTPUT_ONLY_FIELDS = ("min_tokens", "logprobs", "top_logprobs", "prompt_logprobs", "echo", "stream_options")


def _error(status: int, message: str, kind: str = "server_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}}, status_code=status)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("llm_runtime_router_requests", "requests sent to a backend", ["backend", "role"],
                                registry=self.registry)
        self.errors = Counter("llm_runtime_router_errors", "requests a backend failed (connection, 5xx, timeout)",
                              ["backend", "role"], registry=self.registry)
        self.unavailable = Counter("llm_runtime_router_unavailable", "requests answered 503: no healthy backend",
                                   registry=self.registry)


class Router:
    """The pools, the health checks and the forwarding behind the router's routes (module docstring)."""

    def __init__(self, prefill: Sequence[str] = (), decode: Sequence[str] = (), replicas: Sequence[str] = (),
                 policy: str = "round_robin", request_timeout_s: float = 600.0, *, kv_secret: str | None = None,
                 backend_api_key: str | None = None) -> None:
        if bool(prefill) != bool(decode):
            raise ValueError("disaggregated serving needs both --prefill and --decode servers")
        if bool(prefill) == bool(replicas):
            raise ValueError("give --prefill and --decode servers, or --replica servers (not both)")
        self.prefill = Pool([Backend(u.rstrip("/"), "prefill") for u in prefill], policy)
        self.decode = Pool([Backend(u.rstrip("/"), "decode") for u in decode], policy)
        self.replicas = Pool([Backend(u.rstrip("/"), "replica") for u in replicas], policy)
        self.everyone = self.prefill.backends + self.decode.backends + self.replicas.backends
        self.metrics = RouterMetrics()
        self.kv_secret = kv_secret
        # A connection from the pool within 10 s, or the request fails (502) instead of waiting behind others' streams.
        self._timeout = httpx.Timeout(request_timeout_s, connect=2.0, pool=10.0)
        self._limits = httpx.Limits(max_connections=1024, max_keepalive_connections=64)
        self._headers = {"Authorization": f"Bearer {backend_api_key}"} if backend_api_key else {}
        self._client: httpx.AsyncClient | None = None

    @property
    def client(self) -> httpx.AsyncClient:
        assert self._client is not None, "the router is not started"
        return self._client

    # ------------------------------------------------------------------ life cycle and health
    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        self._client = httpx.AsyncClient(timeout=self._timeout, limits=self._limits, headers=self._headers)
        await asyncio.gather(*(self.check(b) for b in self.everyone))
        watcher = asyncio.create_task(self._watch())
        try:
            yield
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            await self._client.aclose()

    async def _watch(self) -> None:
        while True:
            try:
                await asyncio.gather(*(self.check(b) for b in self.everyone))
            except Exception:  # noqa: BLE001 - a probe's surprise is not the end of every later probe
                logger.exception("a health check failed unexpectedly; checking on")
            await asyncio.sleep(HEALTH_INTERVAL_S)

    async def check(self, backend: Backend) -> None:
        """One probe of `backend` (module docstring: gone at once on a refused connection, out of rotation after
        MISSED_PROBES missed ones)."""
        try:
            answer = await self.client.get(f"{backend.url}/health", timeout=HEALTH_TIMEOUT_S)
            missed = None if answer.status_code == 200 else f"/health answered {answer.status_code}"
            if missed is None and backend.role == "decode":
                info = (await self.client.get(f"{backend.url}/v1/kv_transfer", timeout=HEALTH_TIMEOUT_S)).json()
                backend.kv_address = self._kv_address(backend, info)  # again at every probe: it may have restarted
                missed = None if backend.kv_address is not None else "it does not receive KV blocks"
        except httpx.ConnectError as error:  # nothing listens: the server is gone
            backend.missed = MISSED_PROBES
            self.mark_down(backend, f"it refused the connection ({error})", cancel=True)
            return
        except (httpx.HTTPError, ValueError, TypeError, KeyError) as error:
            missed = f"{type(error).__name__}: {error}"
        if missed is None:
            if not backend.healthy:
                logger.warning("backend %s is back in rotation", backend.url)
            backend.missed, backend.healthy = 0, True
            return
        backend.missed += 1
        if backend.missed >= MISSED_PROBES:
            self.mark_down(backend, f"it missed {backend.missed} health checks in a row, the last: {missed}",
                           cancel=False)

    @staticmethod
    def _kv_address(backend: Backend, info: object) -> tuple[str, int] | None:
        """Where a decode server receives KV, from its `/v1/kv_transfer` answer: an address bound on every interface
        (0.0.0.0) is reached at the host of the server's own URL."""
        if not isinstance(info, dict):
            return None
        host, port = info.get("kv_ip"), info.get("kv_port")
        if not isinstance(host, str) or not host or isinstance(port, bool) or not isinstance(port, int) or port <= 0:
            return None
        url_host = urlsplit(backend.url).hostname or ""
        if is_unspecified(host):
            host = url_host or host
        elif is_loopback(host) and not is_loopback(url_host):  # bound on its own loopback, on another machine
            logger.warning("decode server %s receives KV on %s, which no other machine reaches", backend.url, host)
            return None
        return host, port

    def mark_down(self, backend: Backend, why: str, cancel: bool) -> None:
        """Out of rotation; `cancel`: the server is gone, so nothing waits on it (its requests in flight end)."""
        if backend.healthy:
            logger.warning("backend %s is out of rotation: %s", backend.url, why)
        backend.healthy = False
        if cancel:
            for task in list(backend.tasks):
                task.cancel(msg=WENT_DOWN)

    # ------------------------------------------------------------------ forwarding
    async def post(self, backend: Backend, path: str, body: dict[str, Any]) -> httpx.Response:
        """A whole response from a backend (a 5xx counted as an error); BackendFailed when none can be had: the
        connection failed or timed out, or the backend went away meanwhile."""
        self.metrics.requests.labels(backend.url, backend.role).inc()
        backend.in_flight += 1
        task = asyncio.current_task()
        assert task is not None
        backend.tasks.add(task)
        try:
            answer = await self.client.post(f"{backend.url}{path}", json=body)
        except asyncio.CancelledError as error:
            if error.args != (WENT_DOWN,):  # the client left, or the router stops
                raise
            task.uncancel()
            raise BackendFailed(backend, f"the backend {backend.url} went down") from None
        except httpx.HTTPError as error:
            self.metrics.errors.labels(backend.url, backend.role).inc()
            backend.tasks.discard(task)  # its own failure: not cancelled by mark_down below
            if isinstance(error, (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError)):
                self.mark_down(backend, str(error), cancel=True)
            raise BackendFailed(backend, f"the backend {backend.url} failed: {type(error).__name__}: {error}") from error
        finally:
            backend.in_flight -= 1
            backend.tasks.discard(task)
        if answer.status_code >= 500 and answer.status_code != 503:
            self.metrics.errors.labels(backend.url, backend.role).inc()
        return answer

    async def events(self, backend: Backend, path: str, body: dict[str, Any]) -> AsyncIterator[bytes]:
        """A streamed answer's raw bytes, as they come; a backend that fails mid-stream ends it with an error event
        and `[DONE]`, as a server's own failed stream ends. An answer that is not 200 is its JSON, whole."""
        self.metrics.requests.labels(backend.url, backend.role).inc()
        try:
            upstream = await self.client.send(self.client.build_request("POST", f"{backend.url}{path}", json=body),
                                              stream=True)
        except httpx.HTTPError as error:
            self.metrics.errors.labels(backend.url, backend.role).inc()
            if isinstance(error, httpx.ConnectError):  # nothing listens there: gone (a late answer is not)
                self.mark_down(backend, str(error), cancel=True)
            raise BackendFailed(backend, f"the backend {backend.url} failed: {type(error).__name__}: {error}") \
                from error
        if upstream.status_code != 200:
            content = await upstream.aread()
            await upstream.aclose()
            raise Refused(upstream.status_code, content)
        return self._relay_stream(backend, upstream)

    async def _relay_stream(self, backend: Backend, upstream: httpx.Response) -> AsyncIterator[bytes]:
        backend.in_flight += 1
        task = asyncio.current_task()
        if task is not None:
            backend.tasks.add(task)
        failed = None
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        except httpx.HTTPError as error:  # the backend died mid-stream
            self.metrics.errors.labels(backend.url, backend.role).inc()
            if task is not None:
                backend.tasks.discard(task)  # its own failure: not cancelled by mark_down below
            self.mark_down(backend, str(error), cancel=True)
            failed = f"the backend {backend.url} failed mid-stream"
        except asyncio.CancelledError as error:
            if error.args != (WENT_DOWN,):  # the client left, or the router stops
                raise
            if task is not None:
                task.uncancel()
            failed = f"the backend {backend.url} went down mid-stream"  # its health check found it gone
        finally:  # also when the client left: closing the upstream aborts the request there
            backend.in_flight -= 1
            if task is not None:
                backend.tasks.discard(task)
            await upstream.aclose()
        if failed is not None:  # an error event, then the end, as a server's own failed stream ends
            info = {"error": {"message": failed, "type": "server_error", "param": None, "code": None}}
            yield f"data: {json.dumps(info)}\n\ndata: [DONE]\n\n".encode()

    async def relay(self, backend: Backend, path: str, body: dict[str, Any], request: Request) -> Response:
        """The backend's answer to the client: streamed through as it comes, or whole."""
        if body.get("stream"):
            try:
                return StreamingResponse(await self.events(backend, path, body), media_type="text/event-stream")
            except BackendFailed as error:
                return _error(502, str(error))
            except Refused as refused:
                return refused.response()
        answer = await unless_gone(self.post(backend, path, body), request)
        if answer is None:
            return Response(status_code=499)
        if isinstance(answer, BackendFailed):
            return _error(502, str(answer))
        return Response(answer.content, status_code=answer.status_code, media_type="application/json")

    # ------------------------------------------------------------------ routing
    async def route(self, path: str, request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the request body is not valid JSON", "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object", "invalid_request_error")
        body.pop("kv_transfer_params", None)  # the router's to set, never a client's
        if self.replicas.backends:
            backend = self.replicas.choose(prompt_text(body))
            if backend is None:
                self.metrics.unavailable.inc()
                return _error(503, "no healthy replica")
            return await self.relay(backend, path, body, request)
        if body.get("n", 1) != 1:
            return _error(400, "disaggregated serving runs one completion per request (n = 1)",
                          "invalid_request_error")
        if not isinstance(body.get("stream_options") or {}, dict):
            return _error(400, "stream_options must be an object", "invalid_request_error")
        bodies = split_prompts(body) if path == "/v1/completions" else [body]
        if len(bodies) > MAX_PROMPTS:
            return _error(400, f"disaggregated serving takes at most {MAX_PROMPTS} prompts a request, got "
                               f"{len(bodies)}", "invalid_request_error")
        legs = await unless_gone(asyncio.gather(*(self.prefilled(path, one) for one in bodies)), request)
        if legs is None:
            return Response(status_code=499)
        refused = next((leg for leg in legs if isinstance(leg, Response)), None)
        if refused is not None:
            return refused
        decodes: list[tuple[Backend, dict[str, Any]]] = legs  # type: ignore[assignment]
        if len(decodes) == 1:
            server, rest = decodes[0]
            return await self.relay(server, path, rest, request)
        if body.get("stream"):
            streams = [functools.partial(self.events, server, path, one) for server, one in decodes]
            return StreamingResponse(merged_events(streams, MERGED_EVENTS_QUEUED, include_usage=bool(
                (body.get("stream_options") or {}).get("include_usage"))), media_type="text/event-stream")
        answers = await unless_gone(asyncio.gather(*(self.post(server, path, one) for server, one in decodes),
                                                    return_exceptions=True), request)
        if answers is None:
            return Response(status_code=499)
        failed = next((a for a in answers if isinstance(a, BaseException)), None)
        if failed is not None:
            return _error(502, str(failed))
        bad = next((a for a in answers if a.status_code != 200), None)
        if bad is not None:
            return Response(bad.content, status_code=bad.status_code, media_type="application/json")
        return JSONResponse(merge_answers([a.json() for a in answers]))

    def _params(self, params: dict[str, Any]) -> dict[str, Any]:
        return sign_params(self.kv_secret, params) if self.kv_secret is not None else params

    async def prefilled(self, path: str, body: dict[str, Any]) -> tuple[Backend, dict[str, Any]] | Response:
        """Run one prompt's prefill leg; the decode server and the body to send it, or the Response that ends the
        request (the prefill refused, no healthy server, or every prefill server failed)."""
        text = prompt_text(body)
        decode_server = self.decode.choose(text)
        if decode_server is None or decode_server.kv_address is None:
            self.metrics.unavailable.inc()
            return _error(503, "no healthy decode server")
        host, port = decode_server.kv_address
        # A prefill has no effect a client sees, so one whose server died is tried again on another healthy one
        # (under a new transfer id: blocks the dead one may have shipped expire unclaimed).
        failure: BackendFailed | None = None
        tried: list[Backend] = []
        for _ in range(len(self.prefill.backends)):
            prefill_server = self.prefill.choose(text, exclude=tried)
            if prefill_server is None:
                break
            tried.append(prefill_server)
            transfer_id = uuid.uuid4().hex
            first = {name: value for name, value in body.items() if name not in OUTPUT_ONLY_FIELDS}
            first["stream"] = False
            first["max_completion_tokens" if "messages" in body else "max_tokens"] = 1
            first.pop("max_tokens" if "messages" in body else "max_completion_tokens", None)
            first["kv_transfer_params"] = self._params({"do_remote_decode": True, "transfer_id": transfer_id,
                                                        "remote_host": host, "remote_port": port})
            try:
                answer = await self.post(prefill_server, path, first)
            except BackendFailed as error:
                failure = error
                continue
            if answer.status_code != 200:  # the prefill server refused it (a 400 is the client's to see)
                return Response(answer.content, status_code=answer.status_code, media_type="application/json")
            rest = {**body, "kv_transfer_params": self._params({"do_remote_prefill": True,
                                                                "transfer_id": transfer_id})}
            return decode_server, rest
        if failure is not None:
            return _error(502, str(failure))
        self.metrics.unavailable.inc()
        return _error(503, "no healthy prefill server")


def create_router(prefill: Sequence[str] = (), decode: Sequence[str] = (), replicas: Sequence[str] = (),
                  policy: str = "round_robin", request_timeout_s: float = 600.0, *, kv_secret: str | None = None,
                  api_key: str | None = None, backend_api_key: str | None = None,
                  max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    """The router's app (module docstring): `prefill` and `decode` URLs together, or `replicas`. `kv_secret`: sign
    the kv_transfer_params it sets; `api_key`: what clients must send; `backend_api_key`: what it sends its
    backends (by default `api_key`)."""
    router = Router(prefill, decode, replicas, policy, request_timeout_s, kv_secret=kv_secret,
                    backend_api_key=backend_api_key if backend_api_key is not None else api_key)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with router.running():
            yield

    app = FastAPI(title="llm_runtime router", lifespan=lifespan)
    app.add_middleware(BodyLimit, limit=max_request_bytes)
    if api_key is not None:
        app.add_middleware(ApiKeyCheck, api_key=api_key)
    app.state.router = router
    app.state.pools = {"prefill": router.prefill, "decode": router.decode, "replica": router.replicas}

    @app.get("/health")
    async def health() -> JSONResponse:
        pools = [router.prefill, router.decode] if router.prefill.backends else [router.replicas]
        if all(pool.healthy() for pool in pools):
            return JSONResponse({"status": "ok"})
        return _error(503, "no healthy backend for some kind of request")

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> Response:
        pool = router.decode if router.decode.backends else router.replicas
        backend = pool.choose("")
        if backend is None:
            return _error(503, "no healthy backend")
        try:
            answer = await router.client.get(f"{backend.url}/v1/models")
        except httpx.HTTPError as error:
            if isinstance(error, httpx.ConnectError):
                router.mark_down(backend, str(error), cancel=True)
            return _error(502, f"the backend {backend.url} failed: {error}")
        return Response(answer.content, status_code=answer.status_code, media_type="application/json")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router.route("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await router.route("/v1/chat/completions", request)

    return app


def run_router(prefill: list[str], decode: list[str], replicas: list[str], policy: str, host: str, port: int, *,
               kv_secret: str | None = None, api_key: str | None = None, backend_api_key: str | None = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> None:
    import uvicorn

    uvicorn.run(create_router(prefill, decode, replicas, policy, kv_secret=kv_secret, api_key=api_key,
                              backend_api_key=backend_api_key, max_request_bytes=max_request_bytes),
                host=host, port=port, log_level="info")
