"""`AsyncLLMEngine`: the engine behind an event loop, for a server.

One background task owns the `LLMEngine`. Between steps it adds the requests that came in and
applies the aborts; it runs each `step()` in a worker thread, so the event loop keeps answering
clients while the model computes; and it hands every output to its request's stream:

    streams = await engine.add_requests(["Hello"], params)   # InvalidRequestError at once on bad input
    async for output in streams[0]:                          # a RequestOutput after every step it ran in
        print(output.outputs[0].text_delta, end="")

Validation and tokenization (the input processor) run on a third thread, so a long prompt does not
stall the event loop; the busy check comes before them. A request of several prompts is all or
nothing: if one is refused, none is added. A client that stops listening calls `stream.cancel()`
(the server does it when the connection drops): the request is aborted at the next step boundary
and its KV blocks are freed; its id stays taken until then.

One thread runs every step, and it should be the thread that built the engine: PyTorch's CPU
operations run on an OpenMP team owned by the calling thread, and once a second thread has one, the
two teams' workers outnumber a small machine's cores and OpenMP stops spinning between parallel
regions. On this package's 2-core CI machine a one-sequence decode step took 28 ms on the thread that
loaded the model and 41-45 ms on any thread after another one had run PyTorch. So `serve` builds the
engine on `step_thread()` and hands that thread here (`step_executor`); without one, the loop makes its
own thread, which is slower on the CPU when the engine was built elsewhere.

Thread safety: only the loop task touches the engine's state, and only while no step runs.
Handlers read `snapshot`, the engine's stats taken by the loop after each step.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..engine.engine import EngineRequest, EngineStats, LLMEngine, Messages, Prompt
from ..engine.outputs import RequestOutput
from ..errors import EngineBusyError, EngineDeadError, InvalidRequestError
from ..sampling import SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["AsyncLLMEngine", "EngineBusyError", "EngineDeadError", "EngineSnapshot", "RequestStream", "step_thread"]


def step_thread() -> ThreadPoolExecutor:
    """A one-thread executor for everything that runs PyTorch: build the engine on it, then step on it."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="llm-runtime-step")


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's state as the loop saw it after the last step (what handlers may read)."""

    stats: EngineStats
    num_unfinished_requests: int


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

    def __init__(self, engine: LLMEngine, max_waiting_requests: int = 256, *,
                 step_executor: ThreadPoolExecutor | None = None) -> None:
        """`step_executor`: a one-thread executor to run steps on, best the one that built `engine`
        (`step_thread()`); the async engine owns it from now on and shuts it down in `stop()`."""
        if max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {max_waiting_requests}")
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self._new: list[EngineRequest] = []  # validated, not yet in the engine
        self._aborts: set[str] = set()
        self._streams: dict[str, RequestStream] = {}  # every id in use: live, queued, or being aborted
        self._ids = itertools.count()
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._step_executor: ThreadPoolExecutor | None = step_executor
        self._input_executor: ThreadPoolExecutor | None = None
        self._num_processing = 0  # requests being validated on the input thread
        self.snapshot = self._take_snapshot()
        self.error: BaseException | None = None  # what stopped the loop, if anything did
        self.num_aborted = 0  # requests stopped before they finished (cancelled streams)

    # ------------------------------------------------------------------ life cycle
    async def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("the engine loop is already running")
        self._wakeup = asyncio.Event()
        if self._step_executor is None:
            self._step_executor = step_thread()
        # One thread: the tokenizer is not safe to share between threads that encode at once.
        self._input_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llm-runtime-input")
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
        except Exception:  # the loop already died; its error is in self.error
            pass
        self._task = None
        for executor in (self._step_executor, self._input_executor):
            assert executor is not None
            executor.shutdown(wait=True)
        self._step_executor = None
        self._fail_streams(EngineDeadError("the engine stopped"))

    async def shutdown(self) -> None:
        """Stop the loop and free the engine's KV pool (`LLMEngine.shutdown`): nothing can run afterwards."""
        await self.stop()
        self.engine.shutdown()

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def num_waiting(self) -> int:
        """Requests not yet running: being validated, queued here, or waiting in the engine at the last step
        (requests, not sequences: one of n = 4 counts once, as `max_waiting_requests` does)."""
        return self._num_processing + len(self._new) + self.snapshot.stats.num_waiting_requests

    # ------------------------------------------------------------------ requests
    async def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                          request_id: str | None = None) -> RequestStream:
        """One prompt; see `add_requests`."""
        return (await self.add_requests([prompt], params, request_ids=None if request_id is None else [request_id]))[0]

    async def add_requests(self, prompts: Sequence[Prompt], params: SamplingParams | None = None, *,
                           request_ids: Sequence[str] | None = None) -> list[RequestStream]:
        """Validate every prompt off the event loop, then queue them all for the next step, or none.

        Raises EngineDeadError or EngineBusyError (before any tokenization), InvalidRequestError.
        """
        processor = self.engine.input_processor
        return await self._add(len(prompts), request_ids, lambda ids: [
            processor.process(request_id, prompt, params) for request_id, prompt in zip(ids, prompts)])

    async def add_chat(self, messages: Messages, params: SamplingParams | None = None,
                       request_id: str | None = None) -> RequestStream:
        """One conversation, rendered with the chat template off the event loop."""
        processor = self.engine.input_processor
        return (await self._add(1, None if request_id is None else [request_id],
                                lambda ids: [processor.process_chat(ids[0], messages, params)]))[0]

    async def _add(self, count: int, request_ids: Sequence[str] | None,
                   process: Callable[[list[str]], list[EngineRequest]]) -> list[RequestStream]:
        streams = self._reserve(count, request_ids)
        ids = [stream.request_id for stream in streams]
        self._num_processing += count
        try:
            requests = await asyncio.get_running_loop().run_in_executor(self._input_executor, process, ids)
            if not self.is_running:
                raise EngineDeadError("the engine loop stopped" + (f": {self.error!r}" if self.error else ""))
        except BaseException:
            for request_id in ids:
                self._streams.pop(request_id, None)
                self._aborts.discard(request_id)
            raise
        finally:
            self._num_processing -= count
        # A client that left while its prompt was being validated already cancelled its stream.
        self._new += [request for request, stream in zip(requests, streams) if not stream.finished]
        assert self._wakeup is not None
        self._wakeup.set()
        return streams

    def _reserve(self, count: int, request_ids: Sequence[str] | None) -> list[RequestStream]:
        """Checks that cost nothing come first (the loop is alive, the queue has room, the ids are
        free); then the ids are taken, until the request finishes or its abort is applied."""
        if not self.is_running:
            raise EngineDeadError("the engine loop is not running" + (f": {self.error!r}" if self.error else ""))
        if self.num_waiting + count > self.max_waiting_requests:
            raise EngineBusyError(f"server busy: {self.num_waiting} requests are already waiting; retry later")
        ids = [f"req-{next(self._ids)}" for _ in range(count)] if request_ids is None else list(request_ids)
        for i, request_id in enumerate(ids):
            if not isinstance(request_id, str) or not request_id:
                raise InvalidRequestError("request_id", f"request_id must be a non-empty string, got {request_id!r}")
            if request_id in self._streams or request_id in ids[:i]:
                raise InvalidRequestError("request_id", f"request id {request_id!r} is already in use")
        streams = [RequestStream(request_id, self) for request_id in ids]
        for stream in streams:
            self._streams[stream.request_id] = stream
        return streams

    def abort(self, request_id: str) -> None:
        """Stop a request at the next step boundary; its id stays taken until then."""
        if request_id in self._streams:
            self._aborts.add(request_id)
            if self._wakeup is not None:
                self._wakeup.set()

    # ------------------------------------------------------------------ the loop
    def _apply_pending(self) -> None:
        """Between steps: aborted requests leave (their blocks are freed, their ids free), new ones join.

        Whatever goes wrong here for one request ends that request's stream alone (with the error, which the
        server answers as 500), never the loop: the other requests and the ones still to come are served."""
        aborts, self._aborts = self._aborts, set()
        new, self._new = [r for r in self._new if r.request_id not in aborts], []
        for request_id in aborts:
            stream = self._streams.pop(request_id, None)
            self.num_aborted += 1
            try:
                if request_id in self.engine.requests:
                    self.engine.abort_request(request_id)
            except Exception as error:
                logger.exception("aborting request %s failed", request_id)
                if stream is not None:
                    stream._queue.put_nowait(error)
        for request in new:
            try:
                self.engine.add_processed(request)
            except Exception as error:
                logger.exception("adding request %s failed; ending its stream", request.request_id)
                stream = self._streams.pop(request.request_id, None)
                if stream is not None:
                    stream._queue.put_nowait(error)

    def _take_snapshot(self) -> EngineSnapshot:
        return EngineSnapshot(self.engine.stats(), self.engine.num_unfinished_requests())

    def _fail_streams(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream._queue.put_nowait(error)
        self._streams.clear()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._wakeup is not None
        try:
            while True:
                self._apply_pending()
                self.snapshot = self._take_snapshot()
                if not self.engine.has_unfinished_requests():
                    self._wakeup.clear()
                    if not self._new and not self._aborts:
                        await self._wakeup.wait()
                    continue
                outputs = await loop.run_in_executor(self._step_executor, self.engine.step)
                self.snapshot = self._take_snapshot()
                for output in outputs:
                    stream = self._streams.get(output.request_id)
                    if stream is not None and output.request_id not in self._aborts:
                        stream._queue.put_nowait(output)
                        if output.finished:
                            del self._streams[output.request_id]
                await asyncio.sleep(0)  # let the handlers that were just fed run before the next step
        except asyncio.CancelledError:
            raise
        except BaseException as error:  # a bug outside any one request: fail every client, loudly
            logger.exception("the engine loop stopped")
            self.error = error
            self._fail_streams(EngineDeadError(f"the engine loop stopped: {error!r}"))
            raise
