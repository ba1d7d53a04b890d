"""The engine's live feed: what every step ran and what the engine holds, for the dashboard (`/dashboard`).

The async engine's loop calls `EngineFeed.observe` after every step and between steps, on the loop task while no
step runs, so the feed reads the scheduler and the block manager when they are still; handlers only ever see the
events it built. With no subscriber, `observe` returns at once: a server nobody watches builds no event (the engine
keeps its latest step's record, `LLMEngine.last_step`, whoever watches).

    subscription = feed.subscribe()        # a bounded queue; a hello event and the current state are first in it
    async for event in subscription:       # dicts; the server sends each as one server-sent event
        ...

What an event holds (`GET /v1/engine/events` sends them):
- `hello`, once per subscriber: the engine's shape (pool size, block size, token budget, speculation);
- `state`, at most every `interval_s` (besides one for each new subscriber and one when the engine goes idle): the
  steps run since the last one (per request: prefill and decode tokens, drafts verified and kept), the running
  sequences with their block tables, the waiting ones (preempted or not), the requests that finished, one character
  per KV block (free, cached, in use, shared) and the engine's counters.

Each server-sent event's `data` is an `EngineHello` or an `EngineState` (`event_protocol.py`), told apart by `type`.

Batching the steps of one interval into one event keeps the feed's cost bounded by time, not by the step rate: a
batch-1 decode at 250 steps a second still builds 30 events a second. Each subscriber has a queue of
`max_queued` events; one whose queue is full (a page that stopped reading, a stuck connection) is dropped, never
waited for. A dropped page's EventSource reconnects and starts again from a fresh hello and state. At most
`max_subscribers` are held at once: one more gets a stream that ends at once (the server answers 503 first).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

from ..config import SpeculativeConfig
from ..engine.engine import LLMEngine
from ..engine.outputs import RequestOutput
from ..core.sequence import Sequence

logger = logging.getLogger(__name__)

__all__ = ["BLOCK_STATES", "EngineFeed", "Subscription"]

# One character per KV block: free (never used, or forgotten), cached (a prefix no request holds; evictable),
# in use by one sequence, shared by several (prefix hits, forks).
BLOCK_STATES = {"free": ".", "cached": "c", "used": "u", "shared": "s"}
# bytes.translate's table: reference count 0, 1, 2 or more -> free, used, shared (the cached ones come after).
_CODE_TABLE = b".u" + b"s" * 254
# A pool's block states cost time in proportion to its blocks (a GPU's pool can hold 100,000): an event carries them
# only if they took less than 0.5 ms to build, or once this many build times have passed since the last ones.
KV_COST_FACTOR = 50


class Subscription:
    """One subscriber's bounded queue of events; iterating waits for the next, and ends once it is dropped."""

    def __init__(self, max_queued: int) -> None:
        self.max_queued = max_queued
        self.dropped = False  # its queue overflowed: it was too slow, and it gets no more events
        self.closed = False  # it left (unsubscribed) or was dropped
        self._events: deque[dict[str, Any]] = deque()
        self._ready = asyncio.Event()

    def push(self, event: dict[str, Any]) -> bool:
        """Queue an event without waiting; False (and the subscriber is closed) when its queue is full."""
        if self.closed:
            return False
        if len(self._events) >= self.max_queued:
            self.dropped = self.closed = True
            self._events.clear()
            self._ready.set()
            return False
        self._events.append(event)
        self._ready.set()
        return True

    def close(self) -> None:
        """No more events: iteration ends once the queued ones are read."""
        self.closed = True
        self._ready.set()

    @property
    def num_queued(self) -> int:
        return len(self._events)

    def __aiter__(self) -> "Subscription":
        return self

    async def __anext__(self) -> dict[str, Any]:
        while not self._events:
            if self.closed:
                raise StopAsyncIteration
            self._ready.clear()
            await self._ready.wait()
        return self._events.popleft()


class EngineFeed:
    """Builds the dashboard's events from the engine between steps and hands them to every subscriber."""

    def __init__(self, engine: LLMEngine, model_name: str = "", *, interval_s: float = 1 / 30,
                 max_queued: int = 64, max_subscribers: int = 32) -> None:
        if interval_s < 0 or max_queued < 2:
            raise ValueError(f"interval_s must be >= 0 and max_queued >= 2, got {interval_s} and {max_queued}")
        self.engine = engine
        self.model_name = model_name
        self.interval_s = interval_s
        self.max_queued = max_queued
        self.max_subscribers = max_subscribers  # beyond it the server answers 503
        self.origin = time.perf_counter()  # event times are seconds since this (the engine's clock)
        self.subscribers: list[Subscription] = []
        self.num_events = 0  # state events built
        self.num_dropped = 0  # subscribers dropped for not keeping up
        self.num_failures = 0  # times building events failed (every view then ended)
        self.closed = False  # the server is stopping: every stream has ended, and new ones end at once
        self._steps: list[dict[str, Any]] = []  # steps since the last state event
        self._finished: list[dict[str, Any]] = []  # requests finished since the last state event
        self._reasons: dict[str, dict[int, str]] = {}  # request -> completion index -> finish reason, as they come
        self._last_publish = float("-inf")
        self._kv_built, self._kv_cost = float("-inf"), 0.0  # when the block states were last built, how long it took
        self._encoded: tuple[dict[str, Any], str] | None = None  # the latest event and its JSON
        self._awaiting_state = False  # a new subscriber waits for its first state, which the loop builds

    # ------------------------------------------------------------------ subscribers (handlers call these)
    def subscribe(self) -> Subscription:
        """A new subscriber: its first events are a hello and the engine's state (built at the loop's next pass:
        the caller wakes the loop)."""
        subscription = Subscription(self.max_queued)
        if self.closed or self.is_full:  # (the server answers 503 when full, but views that raced past its check
            subscription.close()  # together are held to the limit here)
            return subscription
        subscription.push(self.hello())
        self.subscribers.append(subscription)
        self._awaiting_state = True
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        subscription.close()
        if subscription in self.subscribers:
            self.subscribers.remove(subscription)

    def close(self) -> None:
        """End every stream, and any opened from now on (the server is stopping: nothing must hold it up)."""
        self.closed = True
        for subscription in list(self.subscribers):
            self.unsubscribe(subscription)

    @property
    def is_full(self) -> bool:
        """`max_subscribers` are subscribed: one more is refused."""
        return len(self.subscribers) >= self.max_subscribers

    @property
    def wants_state(self) -> bool:
        """A subscriber waits for its first state: the loop should build one even when the engine is idle."""
        return self._awaiting_state

    def hello(self) -> dict[str, Any]:
        """What stays fixed for the engine's life (no live state: the pool's shape and the engine's limits)."""
        engine, config = self.engine, self.engine.config
        spec = config.speculative_config
        assert spec is None or isinstance(spec, SpeculativeConfig)  # EngineConfig parsed it
        return {"type": "hello", "model": self.model_name, "time": self._time(time.perf_counter()),
                "num_blocks": engine.block_manager.num_total_blocks, "block_size": engine.block_manager.block_size,
                "max_num_seqs": config.max_num_seqs, "max_num_batched_tokens": config.max_num_batched_tokens,
                "max_model_len": engine.max_model_len, "device": str(engine.model.device),
                "kv_cache_dtype": config.kv_cache_dtype, "tensor_parallel_size": config.tensor_parallel_size,
                "speculative": None if spec is None else {"method": spec.method,
                                                          "num_speculative_tokens": spec.num_speculative_tokens},
                "block_states": BLOCK_STATES, "interval_ms": round(self.interval_s * 1e3, 3)}

    # ------------------------------------------------------------------ the loop calls these
    def observe(self, outputs: Iterable[RequestOutput] = (), stepped: bool = False) -> None:
        """After a step (`stepped`, with its outputs) or between steps: record, and publish when it is time. It runs
        in the engine's loop, so whatever fails here ends the live views (each reconnects and starts again from a
        hello), never the loop: watching is never what stops the serving."""
        try:
            self._observe(outputs, stepped)
        except Exception:  # noqa: BLE001 - a bug in building events costs the views, not the requests
            logger.exception("building the live feed's events failed; ending its streams")
            self.num_failures += 1
            for subscription in list(self.subscribers):
                self.unsubscribe(subscription)
            self._awaiting_state = False
            self._steps, self._finished, self._reasons = [], [], {}

    def _observe(self, outputs: Iterable[RequestOutput], stepped: bool) -> None:
        if not self.subscribers:  # (and nothing kept for a later subscriber: it starts from the state it finds)
            self._awaiting_state = False
            self._steps, self._finished, self._reasons = [], [], {}
            return
        engine = self.engine
        if stepped and engine.last_step is not None:
            self._steps.append(self._step(engine))
        for output in outputs:
            reasons = self._reasons.setdefault(output.request_id, {})
            for completion in output.outputs:  # (a streamed request's output holds only what moved this step)
                if completion.finish_reason is not None:
                    reasons[completion.index] = completion.finish_reason
            if output.finished:
                self._finished.append(self._finished_request(output, self._reasons.pop(output.request_id)))
        now = time.perf_counter()
        idle = not engine.has_unfinished_requests()
        if self._awaiting_state or now - self._last_publish >= self.interval_s or (
                idle and (self._steps or self._finished)):
            self.publish(self.state(now))

    def aborted(self, request_id: str) -> None:
        """A request left before it finished (its client went away)."""
        if self.subscribers:
            self._reasons.pop(request_id, None)
            self._finished.append({"id": request_id, "reason": "abort", "arrival": None, "output_tokens": None,
                                   "ttft_ms": None, "itl_ms": None})

    def publish(self, event: dict[str, Any]) -> None:
        """Hand the event to every subscriber; drop those whose queue is full (never wait for one)."""
        self._last_publish = time.perf_counter()
        self._awaiting_state = False
        for subscription in list(self.subscribers):
            if not subscription.push(event):
                self.subscribers.remove(subscription)
                self.num_dropped += subscription.dropped

    # ------------------------------------------------------------------ building events (no step in flight)
    def _time(self, t: float | None) -> float | None:
        return None if t is None else round(t - self.origin, 4)

    def _step(self, engine: LLMEngine) -> dict[str, Any]:
        record = engine.last_step
        assert record is not None
        drafts = record.drafts or [(0, 0)] * len(record.items)
        items = [[request_id, index, num if prefill else 0, 0 if prefill else num, proposed, kept]
                 for (request_id, index, num, prefill), (proposed, kept) in zip(record.items, drafts)]
        return {"step": record.index, "start": self._time(record.start), "duration_ms": round(record.duration * 1e3, 3),
                "items": items, "preempted": [[request_id, index] for request_id, index in record.preempted]}

    def _finished_request(self, output: RequestOutput, reasons: dict[int, str]) -> dict[str, Any]:
        """A finished request, from its last output: the final one's metrics hold every completion's token times
        (a streamed request's output holds only the tokens of its last step), `reasons` each completion's reason."""
        metrics = output.metrics
        ttft = None if metrics.first_token_time is None else metrics.first_token_time - metrics.arrival_time
        times, n = metrics.token_times, max(1, len(reasons))
        per_completion = len(times) / n  # n > 1: the completions' tokens interleave; ITL is one completion's
        itl = (times[-1] - times[0]) / (per_completion - 1) if per_completion > 1 else None
        return {"id": output.request_id, "reason": ",".join(sorted(set(reasons.values()))) or "unknown",
                "arrival": self._time(metrics.arrival_time), "output_tokens": len(times),
                "ttft_ms": None if ttft is None else round(ttft * 1e3, 2),
                "itl_ms": None if itl is None else round(itl * 1e3, 2)}

    def _sequence(self, seq: Sequence, blocks: list[int] | None) -> dict[str, Any]:
        view: dict[str, Any] = {
            "id": seq.request_id, "index": seq.index, "prompt_tokens": seq.num_prompt_tokens,
            "output_tokens": seq.num_output_tokens, "computed_tokens": seq.num_computed_tokens,
            "arrival": self._time(seq.times.arrival), "first_token": self._time(seq.times.first_token)}
        if blocks is not None:
            view["blocks"] = blocks
        else:  # waiting: it ran before, so it was preempted (its blocks were freed, it recomputes)
            view["preempted"] = seq.times.first_scheduled is not None
        return view

    def kv_states(self) -> str:
        """One character per block (BLOCK_STATES), from the reference counts and the prefix cache's parked list."""
        allocator = self.engine.block_manager.allocator
        try:  # counts below 256 (all but a prefix shared by hundreds): one C loop, 1 ms for 100,000 blocks
            refs = bytes(allocator.ref_counts)
        except ValueError:
            refs = bytes(min(r, 2) for r in allocator.ref_counts)
        codes = bytearray(refs.translate(_CODE_TABLE))
        cached = ord(BLOCK_STATES["cached"])
        for block in allocator.prefix_cache.evictable:
            codes[block] = cached
        return codes.decode("ascii")

    def _kv(self, now: float, full: bool) -> dict[str, Any] | None:
        """The pool's block states, or None (unchanged, as far as the page knows) when building them every event would
        cost more than 1/KV_COST_FACTOR of the time: a large pool's are sent less often."""
        if not full and self._kv_cost >= 0.0005 and now - self._kv_built < KV_COST_FACTOR * self._kv_cost:
            return None
        start = time.perf_counter()
        states = self.kv_states()
        self._kv_built, self._kv_cost = start, time.perf_counter() - start
        blocks = self.engine.block_manager
        return {"num_blocks": blocks.num_total_blocks, "block_size": blocks.block_size, "states": states}

    def encode(self, event: dict[str, Any]) -> str:
        """An event as JSON, encoded once for all subscribers (they are handed the same event)."""
        if self._encoded is None or self._encoded[0] is not event:
            self._encoded = (event, json.dumps(event, separators=(",", ":")))
        return self._encoded[1]

    def state(self, now: float) -> dict[str, Any]:
        """A `state` event: the steps and finished requests gathered since the last one, and the engine as it is."""
        engine = self.engine
        scheduler, tables = engine.scheduler, engine.block_manager.block_tables
        stats = engine.stats()
        waiting = [*scheduler.waiting, *(child for children in scheduler.forks.values() for child in children)]
        event = {
            "type": "state", "event": self.num_events, "time": self._time(now), "steps": self._steps,
            "running": [self._sequence(seq, list(tables.get(seq, ()))) for seq in scheduler.running],
            "waiting": [self._sequence(seq, None) for seq in waiting],
            "finished": self._finished,
            "kv": self._kv(now, full=self._awaiting_state or not engine.has_unfinished_requests()),
            "counters": {
                "steps": engine.profile.num_steps, "running": stats.num_running, "waiting": stats.num_waiting,
                "free_blocks": stats.num_free_blocks, "cached_blocks": stats.num_cached_blocks,
                "preemptions": stats.num_preemptions, "prefix_queried_tokens": stats.prefix_cache_queried_tokens,
                "prefix_hit_tokens": stats.prefix_cache_hit_tokens, "failed_requests": stats.num_failed_requests,
                "draft_tokens": stats.num_draft_tokens, "accepted_tokens": stats.num_accepted_tokens,
                "forced_tokens": stats.num_forced_tokens, "accepted_forced_tokens": stats.num_accepted_forced_tokens,
                "native_steps": stats.num_native_steps, "compiled_steps": stats.num_compiled_steps,
                "graph_replays": stats.num_graph_replays}}
        self._steps, self._finished = [], []
        self.num_events += 1
        return event

