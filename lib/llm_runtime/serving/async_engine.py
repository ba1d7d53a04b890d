"""`AsyncLLMEngine`: the engine behind an event loop, for a server.

One background task owns the `LLMEngine`. Between steps it adds the requests that came in and
applies the aborts; it runs each `step()` in a worker thread, so the event loop keeps answering
clients while the model computes; and it hands every output to its request's stream:

    stream = await engine.add_request(prompt, params)   # ValueError at once on bad input
    async for output in stream:                         # RequestOutput after every step it ran in
        print(output.outputs[0].text_delta, end="")

A client that stops listening calls `stream.cancel()` (the server does it when the connection
drops): the request is aborted at the next step boundary and its KV blocks are freed. When too
many requests wait, `add_request` refuses with `EngineBusyError` rather than queueing without bound.
Only the loop task touches the engine's state; everything else goes through the two lists below.
"""

from __future__ import annotations

import asyncio
import itertools
from concurrent.futures import ThreadPoolExecutor

from ..engine.engine import EngineRequest, LLMEngine, Prompt
from ..engine.outputs import RequestOutput
from ..sampling import SamplingParams


class EngineBusyError(RuntimeError):
    """The waiting queue is full: try again later (HTTP 503)."""


class RequestStream:
    """The outputs of one request, in order; iteration ends after the finished one."""

    def __init__(self, request_id: str, engine: "AsyncLLMEngine") -> None:
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

    def cancel(self) -> None:
        """Stop the request (a no-op once it finished); its blocks are freed at the next step boundary."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)


class AsyncLLMEngine:
    """Drives an `LLMEngine` from one background task; many concurrent clients, one model."""

    def __init__(self, engine: LLMEngine, max_waiting_requests: int = 256) -> None:
        if max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {max_waiting_requests}")
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self._new: list[EngineRequest] = []  # validated, not yet in the engine
        self._aborts: set[str] = set()
        self._streams: dict[str, RequestStream] = {}
        self._ids = itertools.count()
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._executor: ThreadPoolExecutor | None = None
        self.error: BaseException | None = None  # what stopped the loop, if anything did
        self.num_aborted = 0  # requests stopped before they finished (cancelled streams)

    # ------------------------------------------------------------------ life cycle
    async def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("the engine loop is already running")
        self._wakeup = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llm-runtime-step")
        self._task = asyncio.create_task(self._run(), name="llm-runtime-engine-loop")

    async def stop(self) -> None:
        """Stop the loop (a step in flight finishes first); every open stream ends with an error."""
        if self._task is None:
            return
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        self._task = None
        assert self._executor is not None
        self._executor.shutdown(wait=True)
        for stream in self._streams.values():
            stream._queue.put_nowait(RuntimeError("the engine stopped"))
        self._streams.clear()

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def num_waiting(self) -> int:
        return len(self._new) + self.engine.stats().num_waiting

    # ------------------------------------------------------------------ requests
    async def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                          request_id: str | None = None) -> RequestStream:
        """Validate now (ValueError), refuse when busy (EngineBusyError), else queue for the next step."""
        if not self.is_running:
            raise RuntimeError("the engine loop is not running" + (f": {self.error!r}" if self.error else ""))
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = self.engine.prepare_request(request_id, prompt, params)
        if self.num_waiting >= self.max_waiting_requests:
            raise EngineBusyError(f"server busy: {self.num_waiting} requests are already waiting; retry later")
        stream = RequestStream(request_id, self)
        self._streams[request_id] = stream
        self._new.append(request)
        assert self._wakeup is not None
        self._wakeup.set()
        return stream

    def abort(self, request_id: str) -> None:
        self._aborts.add(request_id)
        self._streams.pop(request_id, None)
        if self._wakeup is not None:
            self._wakeup.set()

    # ------------------------------------------------------------------ the loop
    def _apply_pending(self) -> None:
        """Between steps: new requests join, aborted ones leave (their blocks are freed)."""
        aborts, self._aborts = self._aborts, set()
        new, self._new = [r for r in self._new if r.request_id not in aborts], []
        for request_id in aborts:
            if request_id in self.engine.requests:
                self.engine.abort_request(request_id)
                self.num_aborted += 1
        for request in new:
            self.engine.add_prepared(request)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._wakeup is not None
        try:
            while True:
                self._apply_pending()
                if not self.engine.has_unfinished_requests():
                    self._wakeup.clear()
                    if not self._new and not self._aborts:
                        await self._wakeup.wait()
                    continue
                outputs = await loop.run_in_executor(self._executor, self.engine.step)
                for output in outputs:
                    stream = self._streams.get(output.request_id)
                    if stream is not None:
                        stream._queue.put_nowait(output)
                        if output.finished:
                            del self._streams[output.request_id]
                await asyncio.sleep(0)  # let the handlers that were just fed run before the next step
        except asyncio.CancelledError:
            raise
        except BaseException as error:  # a bug or an out-of-memory: fail every client, loudly
            self.error = error
            for stream in self._streams.values():
                stream._queue.put_nowait(error)
            self._streams.clear()
            raise
