"""`AsyncLLMEngine`: the engine behind an event loop, for a server.

One background task owns the `LLMEngine`. Between steps it adds the requests that came in and
applies the aborts; it runs each `step()` in a worker thread, so the event loop keeps answering
clients while the model computes; and it hands every output to its request's stream:

    streams = await engine.add_requests(["Hello"], params)   # InvalidRequestError at once on bad input
    async for output in streams[0]:                          # a RequestOutput after every step it ran in
        print(output.outputs[0].text_delta, end="")

Validation and tokenization (the input processor) run on a third thread, so a long prompt does not
stall the event loop; the busy check comes before them. A constrained request's grammar compiles on the
compiler's own workers, and the request awaits it on the loop, so neither the loop nor the input thread waits
for a compile (structured_output/compiler.py). A request of several prompts is all or
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
Handlers read `snapshot`, the engine's stats taken by the loop after each step, and the events of `feed`
(engine_events.py: the dashboard's live view), which the loop builds at the same points when anyone subscribed.

KV transfer (lesson 18, serving/kv_agent.py): with an agent, a request may carry `kv_transfer_params`. The loop
runs the agent on the step thread around every step (blocks received go into the pool before it, finished
prefills' blocks are shipped after it), and holds a request that waits for its prompt's blocks until they came
(or the agent's timeout passed: it then computes its prompt itself).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..engine.engine import EngineRequest, EngineStats, LLMEngine, Messages, Prompt
from ..engine.outputs import RequestOutput
from ..errors import EngineBusyError, EngineDeadError, InvalidRequestError
from .kv_agent import KVTransferAgent, TransferParams
from ..sampling import SamplingParams
from .engine_events import EngineFeed, Subscription
from .request_stream import RequestStream

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


class AsyncLLMEngine:
    """Drives an `LLMEngine` from one background task; many concurrent clients, one model."""

    def __init__(self, engine: LLMEngine, max_waiting_requests: int = 256, *,
                 step_executor: ThreadPoolExecutor | None = None, kv_transfer: KVTransferAgent | None = None,
                 feed: EngineFeed | None = None) -> None:
        """`step_executor`: a one-thread executor to run steps on, best the one that built `engine`
        (`step_thread()`); the async engine owns it from now on and shuts it down in `stop()`. `kv_transfer`:
        this server's part in disaggregated prefill and decode (module docstring). `feed`: the live view's
        events (engine_events.py; one of its own by default)."""
        if max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {max_waiting_requests}")
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self._new: list[EngineRequest] = []  # validated, not yet in the engine
        self._aborts: set[str] = set()
        self._resets: list[asyncio.Future[int]] = []  # reset_prefix_cache calls, answered between steps
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
        self.kv_transfer = kv_transfer
        self._transfers: dict[str, TransferParams] = {}  # request id -> its kv_transfer_params
        self._awaiting_kv: list[tuple[EngineRequest, float]] = []  # (request, deadline): blocks still to come
        self._discards: list[str] = []  # transfers whose requests were refused: their blocks go between steps
        self._loop: asyncio.AbstractEventLoop | None = None
        self.feed = feed if feed is not None else EngineFeed(engine)

    # ------------------------------------------------------------------ life cycle
    async def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("the engine loop is already running")
        self._wakeup = asyncio.Event()
        self._loop = asyncio.get_running_loop()
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
    def is_full(self) -> bool:
        """Whether a new request would be refused as busy now (`max_waiting_requests`)."""
        return self.num_waiting >= self.max_waiting_requests

    def wake(self) -> None:
        """Wake the loop from any thread (the KV receiver's, when a payload waits to be taken in)."""
        loop, wakeup = self._loop, self._wakeup
        if loop is not None and wakeup is not None and not loop.is_closed():
            loop.call_soon_threadsafe(wakeup.set)

    @property
    def num_waiting(self) -> int:
        """Requests not yet running: being validated, queued here, or waiting in the engine at the last step
        (requests, not sequences: one of n = 4 counts once, as `max_waiting_requests` does)."""
        return (self._num_processing + len(self._new) + len(self._awaiting_kv)
                + self.snapshot.stats.num_waiting_requests)

    # ------------------------------------------------------------------ requests
    async def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                          request_id: str | None = None) -> RequestStream:
        """One prompt; see `add_requests`."""
        return (await self.add_requests([prompt], params, request_ids=None if request_id is None else [request_id]))[0]

    async def add_requests(self, prompts: Sequence[Prompt], params: SamplingParams | None = None, *,
                           request_ids: Sequence[str] | None = None,
                           kv_transfer_params: dict | None = None) -> list[RequestStream]:
        """Validate every prompt off the event loop, then queue them all for the next step, or none.

        Raises EngineDeadError or EngineBusyError (before any tokenization), InvalidRequestError.
        """
        processor = self.engine.input_processor
        return await self._add(len(prompts), request_ids, lambda ids: [
            processor.process(request_id, prompt, params, wait_for_grammar=False)
            for request_id, prompt in zip(ids, prompts)], kv_transfer_params)

    async def add_chat(self, messages: Messages, params: SamplingParams | None = None,
                       request_id: str | None = None, kv_transfer_params: dict | None = None) -> RequestStream:
        """One conversation, rendered with the chat template off the event loop."""
        processor = self.engine.input_processor
        return (await self._add(1, None if request_id is None else [request_id],
                                lambda ids: [processor.process_chat(ids[0], messages, params, wait_for_grammar=False)],
                                kv_transfer_params))[0]

    def _transfer_params(self, count: int, kv_transfer_params: dict | None) -> TransferParams | None:
        if kv_transfer_params is None:
            return None
        if self.kv_transfer is None:
            raise InvalidRequestError("kv_transfer_params", "this server takes no part in KV transfer (start it "
                                                            "with --kv-transfer-config)")
        try:
            params = self.kv_transfer.parse(kv_transfer_params)
        except ValueError as error:
            raise InvalidRequestError("kv_transfer_params", str(error)) from error
        if count != 1:
            self._refused_transfer(params)
            raise InvalidRequestError("kv_transfer_params", "a KV transfer is for one prompt")
        return params

    def _refused_transfer(self, params: TransferParams | None) -> None:
        """A request that would have claimed received blocks was refused: they go at the next step boundary."""
        if params is not None and params.remote_prefill:
            self._discards.append(params.transfer_id)
            if self._wakeup is not None:
                self._wakeup.set()

    async def _add(self, count: int, request_ids: Sequence[str] | None,
                   process: Callable[[list[str]], list[EngineRequest]],
                   kv_transfer_params: dict | None = None) -> list[RequestStream]:
        transfer = self._transfer_params(count, kv_transfer_params)
        try:
            streams = self._reserve(count, request_ids)
        except BaseException:
            self._refused_transfer(transfer)
            raise
        ids = [stream.request_id for stream in streams]
        self._num_processing += count
        try:
            requests = await asyncio.get_running_loop().run_in_executor(self._input_executor, process, ids)
            # A constrained request waits for its grammar here, on the loop: the input thread goes on tokenizing.
            requests = list(await asyncio.gather(*(request.compiled_async() for request in requests)))
            if not self.is_running:
                raise EngineDeadError("the engine loop stopped" + (f": {self.error!r}" if self.error else ""))
        except BaseException:
            for request_id in ids:
                self._streams.pop(request_id, None)
                self._aborts.discard(request_id)
            self._refused_transfer(transfer)
            raise
        finally:
            self._num_processing -= count
        # A client that left while its prompt was being validated already cancelled its stream.
        if transfer is not None:
            self._transfers[ids[0]] = transfer
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

    async def reset_prefix_cache(self) -> int:
        """Forget every cached block no request holds, between two steps; the blocks freed. (vLLM's refuses, and
        returns False, while any block is in use; this one frees what no request holds and leaves the rest.)"""
        if not self.is_running:
            raise EngineDeadError(f"the engine loop stopped: {self.error!r}")
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._resets.append(future)
        if self._wakeup is not None:
            self._wakeup.set()
        return await future

    def subscribe_events(self) -> Subscription:
        """The engine's live events (engine_events.py): a hello, then the state as the loop sees it between steps.
        Call `feed.unsubscribe` when done; a subscriber that stops reading is dropped."""
        subscription = self.feed.subscribe()
        if self._wakeup is not None:  # an idle loop builds the first state now
            self._wakeup.set()
        return subscription

    # ------------------------------------------------------------------ the loop
    def _apply_pending(self) -> None:
        """Between steps: aborted requests leave (their blocks are freed, their ids free), new ones join.

        Whatever goes wrong here for one request ends that request's stream alone (with the error, which the
        server answers as 500), never the loop: the other requests and the ones still to come are served."""
        resets, self._resets = self._resets, []
        for future in resets:
            if not future.done():
                try:
                    future.set_result(self.engine.reset_prefix_cache())
                except Exception as error:  # the caller's to see, never the loop's end
                    future.set_exception(error)
        discards, self._discards = self._discards, []
        for transfer_id in discards:
            assert self.kv_transfer is not None
            self.kv_transfer.discard(transfer_id)
        aborts, self._aborts = self._aborts, set()
        queued = {r.request_id for r in self._new} | {r.request_id for r, _ in self._awaiting_kv}
        new, self._new = [r for r in self._new if r.request_id not in aborts], []
        new = self._with_their_kv(new, aborts)
        for request_id in aborts:
            stream = self._streams.pop(request_id, None)
            self.num_aborted += 1
            if request_id in self.engine.requests or request_id in queued:  # (not one that finished meanwhile)
                self.feed.aborted(request_id)
            self._transfers.pop(request_id, None)
            if self.kv_transfer is not None:
                self.kv_transfer.forget(request_id)
            try:
                if request_id in self.engine.requests:
                    self.engine.abort_request(request_id)
            except Exception as error:
                logger.exception("aborting request %s failed", request_id)
                if stream is not None:
                    stream.put(error)
        for request in new:
            try:
                self.engine.add_processed(request)
            except Exception as error:
                logger.exception("adding request %s failed; ending its stream", request.request_id)
                if self.kv_transfer is not None:  # the blocks it claimed go, and nothing is shipped for it
                    self.kv_transfer.forget(request.request_id)
                stream = self._streams.pop(request.request_id, None)
                if stream is not None:
                    stream.put(error)

    def _with_their_kv(self, new: list[EngineRequest], aborts: set[str]) -> list[EngineRequest]:
        """The requests to add now: `new` ones and those whose prompt's blocks arrived (or stopped being waited
        for); the others wait on. Producer requests are registered to ship when they finish."""
        if self.kv_transfer is None:
            return new
        agent, now = self.kv_transfer, time.monotonic()
        waiting = [(r, d) for r, d in self._awaiting_kv if r.request_id not in aborts]
        waiting += [(r, now + agent.config.kv_transfer_timeout_s) for r in new
                    if r.request_id in self._transfers and self._transfers[r.request_id].remote_prefill]
        ready = [r for r in new if r.request_id not in self._transfers or self._transfers[r.request_id].remote_decode]
        self._awaiting_kv = []
        for request, deadline in waiting:
            transfer = self._transfers[request.request_id]
            if agent.ready(transfer.transfer_id) or now >= deadline:
                if not agent.ready(transfer.transfer_id):
                    logger.warning("request %s: no KV for transfer %s within %.0f s; computing its prompt",
                                   request.request_id, transfer.transfer_id, agent.config.kv_transfer_timeout_s)
                agent.claim(request.request_id, transfer, request.prompt_token_ids)
                ready.append(request)
            else:
                self._awaiting_kv.append((request, deadline))
        for request in ready:
            transfer = self._transfers.pop(request.request_id, None)
            if transfer is not None and transfer.remote_decode:
                agent.expect(request.request_id, transfer)
        return ready

    def _step(self, admit_kv: bool = True) -> list[RequestOutput]:
        """One engine step, with the agent's work around it (on the step thread). `admit_kv`: take in received
        blocks (False while the server refuses requests as busy: the blocks' requests would be refused too)."""
        if self.kv_transfer is None:
            return self.engine.step()
        self.kv_transfer.before_step(admit=admit_kv)
        outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
        self.kv_transfer.after_step(outputs)
        return outputs

    def _kv_due_in(self) -> float | None:
        """Seconds until the agent has work while the engine is idle (0: now), or None: none is due."""
        agent = self.kv_transfer
        if agent is None:
            return None
        if agent.receiver is not None and agent.receiver.num_waiting:
            return 0.0
        due = [deadline - time.monotonic() for _, deadline in self._awaiting_kv]
        expiry = agent.seconds_to_next_expiry()
        due += [] if expiry is None else [expiry]
        return max(0.0, min(due)) if due else None

    def _take_snapshot(self) -> EngineSnapshot:
        return EngineSnapshot(self.engine.stats(), self.engine.num_unfinished_requests())

    def _fail_streams(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream.put(error)
        self._streams.clear()
        for subscription in list(self.feed.subscribers):  # the live view's streams end too
            self.feed.unsubscribe(subscription)
        resets, self._resets = self._resets, []
        for future in resets:
            if not future.done():
                future.set_exception(error)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._wakeup is not None
        try:
            while True:
                self._apply_pending()
                self.snapshot = self._take_snapshot()
                self.feed.observe()
                if not self.engine.has_unfinished_requests():
                    self._wakeup.clear()
                    due = self._kv_due_in()
                    if due == 0.0:  # take in what arrived, let go of what waited too long (an idle server too)
                        await loop.run_in_executor(self._step_executor, self._step, not self.is_full)
                    elif not (self._new or self._aborts or self._resets or self._discards or self.feed.wants_state):
                        # Until a request, an abort, a payload (the receiver wakes the loop) or the next expiry.
                        with contextlib.suppress(asyncio.TimeoutError):
                            await asyncio.wait_for(self._wakeup.wait(), timeout=due)
                    continue
                outputs = await loop.run_in_executor(self._step_executor, self._step, not self.is_full)
                self.snapshot = self._take_snapshot()
                self.feed.observe(outputs, stepped=True)
                for output in outputs:
                    stream = self._streams.get(output.request_id)
                    if stream is not None and output.request_id not in self._aborts:
                        stream.put(output)
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
