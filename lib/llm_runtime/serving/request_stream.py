"""`RequestStream`: one request's outputs as the async engine delivers them, in order, to the handler that awaits
them; cancelling it aborts the request."""

from __future__ import annotations

import asyncio
from typing import Protocol

from ..engine.outputs import RequestOutput


class Aborts(Protocol):
    """What a stream asks of the engine it belongs to (serving/async_engine.py's AsyncLLMEngine)."""

    def abort(self, request_id: str) -> None: ...


class RequestStream:
    """The outputs of one request, in order; iteration ends after the finished one."""

    def __init__(self, request_id: str, engine: Aborts) -> None:
        self.request_id = request_id
        self.finished = False
        self._engine = engine
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def put(self, item: RequestOutput | BaseException) -> None:
        """The engine's loop hands the stream its next output, or the error that ends it."""
        self._queue.put_nowait(item)

    def cancel(self) -> None:
        """Stop the request (a no-op once it finished); its blocks are freed at the next step boundary."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)
