"""Lesson 10 exercises: the two sides of serving, checked against the package's server and async engine.

- `parse_chat_stream(body)`: a client's job, reassembling each choice's text and finish reason from a
  streamed chat completion, against the non-streamed response the server builds from the same
  outputs (`serving/responses.py`; the stream framed as the server frames it, `serving/server.py`).
- `is_busy(num_waiting, num_new, max_waiting_requests)`: the back-pressure rule, against the answers
  a real `AsyncLLMEngine` gives a burst of requests.

The checkers run their event loops on a thread of their own, so they work inside Jupyter (whose
loop is already running) as well as in a plain script.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any, TypeVar

from ...engine.engine import EngineStats
from ...engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from ...errors import EngineBusyError
from ...sampling import SamplingParams
from ...serving.async_engine import AsyncLLMEngine
from ...serving.responses import Formatter, OpenAIResponse
from ...serving.server import sse_events
from .check import Case, Verdict, run_cases, same_value

T = TypeVar("T")


def _run_async(coroutine: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run a coroutine to the end on a fresh event loop in a worker thread (Jupyter already runs one here)."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(lambda: asyncio.run(coroutine())).result()


# ------------------------------------------------------------------------------------------ streams
class _Replay:
    """Stands in for a `RequestStream`: yields recorded outputs, as the engine loop hands them over."""

    def __init__(self, outputs: list[RequestOutput]) -> None:
        self.outputs = outputs

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        for output in self.outputs:
            yield output

    def cancel(self) -> None:
        pass


class _NoMetrics:
    """Stands in for the server's Prometheus metrics."""

    def record(self, output: RequestOutput, num_generated_tokens: int) -> None:
        pass


_PIECES = ["Hello", " world", ",", " the", "\n", "é", "☕", '"quoted"', " data: x", "{", "}", "\\", "", " and"]
_METRICS = RequestMetrics(arrival_time=0.0, first_scheduled_time=None, first_token_time=None, last_token_time=None,
                          finished_time=None)


def _request_outputs(rng: random.Random, n: int, pieces: list[str] | None = None
                     ) -> tuple[list[RequestOutput], RequestOutput]:
    """A request's DELTA outputs step by step (only the completions that moved, as the engine sends them to a
    stream), and its final output with each completion's whole text."""
    texts: list[str] = [""] * n
    reasons: list[str | None] = [None] * n
    counts = [0] * n
    steps: list[RequestOutput] = []
    queue = list(pieces or [])
    while any(reason is None for reason in reasons):
        running = [i for i in range(n) if reasons[i] is None]
        moved = [i for i in running if rng.random() < 0.75] or running[:1]
        completions = []
        for i in moved:
            piece = queue.pop(0) if queue else rng.choice(_PIECES)
            texts[i] += piece
            counts[i] += 1
            if (pieces is not None and not queue) or (pieces is None and rng.random() < 0.3):
                reasons[i] = rng.choice(["stop", "length"])
            completions.append(CompletionOutput(index=i, text=piece, token_ids=[7], finish_reason=reasons[i],
                                                text_delta=piece, token_ids_delta=[7]))
        finished = all(reason is not None for reason in reasons)
        steps.append(RequestOutput("exercise", None, [1, 2, 3], completions, finished, _METRICS))
    final = RequestOutput("exercise", None, [1, 2, 3], [
        CompletionOutput(index=i, text=texts[i], token_ids=[7] * counts[i], finish_reason=reasons[i])
        for i in range(n)], True, _METRICS)
    return steps, final


async def _stream_and_response(steps: list[RequestOutput], final: RequestOutput, n: int, include_usage: bool
                               ) -> tuple[str, list[tuple[str, str | None]]]:
    """The server's SSE body for these outputs, and the (text, finish_reason) of each choice of the
    non-streamed response built from the same request."""
    formatter = Formatter(SimpleNamespace(tokenizer=None), "exercise-model")  # type: ignore[arg-type]
    streamed = OpenAIResponse(formatter, n, chat=True, num_top=0).stream(
        [_Replay(steps)], _NoMetrics(), include_usage)  # type: ignore[list-item, arg-type]
    body = "".join([event async for event in sse_events(streamed)])
    response = await OpenAIResponse(formatter, n, chat=True, num_top=0).collect(
        [_Replay([final])], _NoMetrics())  # type: ignore[list-item, arg-type]
    choices = sorted(response["choices"], key=lambda choice: choice["index"])
    return body, [(choice["message"]["content"], choice["finish_reason"]) for choice in choices]


def check_parse_chat_stream(fn: object) -> Verdict:
    """`parse_chat_stream(body) -> list[(text, finish_reason)]`: `body` is the whole text of a streamed
    chat completion as the server sends it: server-sent events, each a line `data: <JSON>` followed by
    a blank line, ending with `data: [DONE]`. Each JSON chunk has `choices`, a list of
    {"index", "delta": {"role"?, "content"}, "finish_reason"}; the first chunk only sets the role, and
    with usage asked for, the last chunk before [DONE] has no choices at all. Return, for choice 0, 1,
    ... in order, its whole text (every delta's content joined) and its finish reason (the one chunk
    that carries it)."""

    def cases() -> list[Case]:
        rng = random.Random(10)
        inputs = [(1, ["Hello", " world"], False, "one choice"), (1, ["Say ", "[DONE]", " when done"], True,
                                                                   "a text that contains [DONE], and a usage chunk"),
                  (2, ["a", "b", "c", "d"], False, "two choices, interleaved")]
        inputs += [(rng.randint(1, 3), None, rng.random() < 0.5, "") for _ in range(20)]

        async def build() -> list[Case]:
            out = []
            for n, pieces, include_usage, note in inputs:
                steps, final = _request_outputs(rng, n, pieces)
                body, expected = await _stream_and_response(steps, final, n, include_usage)
                out.append(Case({"body": body}, expected, note))
            return out

        return _run_async(build)

    return run_cases("parse_chat_stream", fn, cases, same_value,
                     "llm_runtime.serving.responses.OpenAIResponse (collect against stream)")


# ------------------------------------------------------------------------------------------ back-pressure
class _Request:
    """What the async engine reads of an `EngineRequest`: its id, and its grammar compiled (there is none)."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id

    async def compiled_async(self) -> "_Request":
        return self


class _StalledEngine:
    """Stands in for `LLMEngine` behind `AsyncLLMEngine`: it accepts every request and runs none (a GPU
    busy with long requests), so every request the async engine lets in stays waiting."""

    def __init__(self, num_waiting: int) -> None:
        self.num_waiting = num_waiting
        self.input_processor = self

    def process(self, request_id: str, prompt: object, params: object, wait_for_grammar: bool = True) -> "_Request":
        return _Request(request_id)

    def stats(self) -> EngineStats:
        return EngineStats(num_total_blocks=1, num_free_blocks=1, num_cached_blocks=0, block_size=16, num_running=0,
                           num_waiting=self.num_waiting, num_preemptions=0, prefix_cache_queried_tokens=0,
                           prefix_cache_hit_tokens=0, num_waiting_requests=self.num_waiting)

    def num_unfinished_requests(self) -> int:
        return self.num_waiting

    def has_unfinished_requests(self) -> bool:
        return False  # nothing to step: the loop only takes requests in

    def add_processed(self, request: object) -> None:
        self.num_waiting += 1


async def _bursts(initial_waiting: int, sizes: list[int], max_waiting_requests: int) -> list[tuple[int, int, bool]]:
    """Send bursts of requests to a real AsyncLLMEngine; (requests waiting before, burst size, answered busy)."""
    engine = AsyncLLMEngine(_StalledEngine(initial_waiting), max_waiting_requests)  # type: ignore[arg-type]
    await engine.start()
    answers = []
    try:
        for size in sizes:
            waiting = engine.num_waiting
            try:
                await engine.add_requests(["hello"] * size, SamplingParams())
                busy = False
            except EngineBusyError:
                busy = True
            answers.append((waiting, size, busy))
            for _ in range(3):
                await asyncio.sleep(0)  # let the loop take the new requests in
    finally:
        await engine.stop()
    return answers


def check_is_busy(fn: object) -> Verdict:
    """`is_busy(num_waiting, num_new, max_waiting_requests) -> bool`: a client sends `num_new` prompts at
    once while `num_waiting` requests are already waiting (being validated, queued for the next step,
    or in the engine's waiting queue). Return True when the server must answer "busy" (HTTP 503): the
    waiting requests would exceed `max_waiting_requests`. A request of several prompts is all or nothing."""

    def cases() -> list[Case]:
        rng = random.Random(10)
        scenarios = [(0, [1, 1, 1], 2, "two fit, the third is refused"), (0, [3], 2, "a burst larger than the queue"),
                     (1, [2, 1], 3, "exactly full is not busy")]
        for _ in range(12):
            limit = rng.randint(1, 8)
            sizes = [rng.randint(1, 4) for _ in range(rng.randint(1, 6))]
            scenarios.append((rng.randint(0, limit + 1), sizes, limit, ""))

        async def build() -> list[Case]:
            out = []
            for initial, sizes, limit, note in scenarios:
                for number, (waiting, size, busy) in enumerate(await _bursts(initial, sizes, limit), start=1):
                    out.append(Case({"num_waiting": waiting, "num_new": size, "max_waiting_requests": limit}, busy,
                                    f"burst {number} of {len(sizes)}" + (f": {note}" if note else "")))
            return out

        return _run_async(build)

    return run_cases("is_busy", fn, cases, same_value, "llm_runtime.serving.async_engine.AsyncLLMEngine")
