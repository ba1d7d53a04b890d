"""What stands between a socket and a route, for the server and the router alike: a body limit and an API key.

`BodyLimit` answers 413 to a body over the limit before any of it reaches the app (a declared length is refused
unread; an undeclared one is read only up to the limit). `ApiKeyCheck` is vLLM's `--api-key`: every route under
`/v1` (and any other path named) wants `Authorization: Bearer <key>`, compared in constant time, and answers 401
without it; `/health`, `/metrics` and the dashboard's page stay open, as vLLM leaves its own. A browser's
EventSource sends no headers, so the live feed (`GET /v1/engine/events`) also takes the key as `?api_key=`, which
the dashboard passes on from its own address; `RedactApiKey` keeps it out of the access log.
"""

from __future__ import annotations

import hmac
import logging
import re
from collections.abc import Collection
from urllib.parse import parse_qs

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .responses import APIError

API_KEY_ENV = "LLM_RUNTIME_API_KEY"  # where the command line looks for --api-key's value when none is given


class BodyLimit:
    """ASGI middleware: a body over `limit` bytes gets 413 before the app reads any of it."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = APIError(413, f"the request body is over the server's limit of {self.limit} bytes")
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await too_large.response()(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break  # the client left before sending the whole body
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await too_large.response()(scope, receive, send)
            if not message.get("more_body"):
                break
        replayed = False

        async def replay() -> Message:  # the whole body once, then the client's own messages (disconnect)
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)


class ApiKeyCheck:
    """ASGI middleware: requests to `/v1/...` (and `paths`) need the bearer token `api_key`, else 401."""

    def __init__(self, app: ASGIApp, api_key: str, paths: Collection[str] = (),
                 query_paths: Collection[str] = ("/v1/engine/events",)) -> None:
        if not isinstance(api_key, str) or not api_key:
            raise ValueError("api_key must be a non-empty string")
        self.app, self.paths, self.query_paths = app, frozenset(paths), frozenset(query_paths)
        self._expected = f"Bearer {api_key}".encode("utf-8")
        self._key = api_key.encode("utf-8")

    def _protected(self, path: str) -> bool:
        return path == "/v1" or path.startswith("/v1/") or path in self.paths

    def _authorized(self, scope: Scope) -> bool:
        given = dict(scope.get("headers") or []).get(b"authorization", b"")
        if hmac.compare_digest(given, self._expected):
            return True
        if scope["path"] in self.query_paths:  # (percent-escapes of any bytes: decoded as UTF-8, the key's own)
            keys = parse_qs(scope.get("query_string", b"").decode("latin-1"), errors="replace").get("api_key", [])
            return any(hmac.compare_digest(key.encode("utf-8", errors="replace"), self._key) for key in keys[:1])
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or not self._protected(scope["path"]) \
                or self._authorized(scope):
            return await self.app(scope, receive, send)
        refused = APIError(401, "this server wants an API key: send `Authorization: Bearer <key>`",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await refused.response()(scope, receive, send)


class RedactApiKey(logging.Filter):
    """A logging filter for uvicorn's access log: an `api_key=` in a logged address shows as `api_key=...`."""

    _KEY = re.compile(r"(api_key=)[^&\s\"]*")

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(self._KEY.sub(r"\1...", arg) if isinstance(arg, str) else arg for arg in record.args)
        return True
