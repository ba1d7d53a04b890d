"""A server's part in KV transfer (lesson 18), between the async engine and the transport.

A request's `kv_transfer_params` (vLLM's name; the router sets them) say what to do with it:

- `{"do_remote_decode": true, "transfer_id": ..., "remote_host": ..., "remote_port": ...}` on a producer: compute
  the prompt (the router asks for one token), and when the request finishes, ship its prompt's blocks to the
  consumer at remote_host:remote_port, named by transfer_id;
- `{"do_remote_prefill": true, "transfer_id": ...}` on a consumer: wait until the blocks named transfer_id have
  arrived (at most `kv_transfer_timeout_s`; then compute the prompt here), then run the request, whose prompt
  finds them in the prefix cache; when it finishes, let them go.

Every method that touches the engine runs between steps: on the step thread around a step (`before_step`,
`after_step`), or on the event loop's thread while no step runs (`forget`, as the async engine aborts requests);
never during a step. The sender's thread only ships what `after_step` read, and counts it: the counters are
written under a lock and read as a `snapshot()`. Received blocks no request claims within the timeout are let
go too (a router that sent the prefill and then lost its client).
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from ..engine.engine import LLMEngine
from ..engine.outputs import RequestOutput
from .config import KVTransferConfig
from .zmq_connector import KVReceiver, KVSender

logger = logging.getLogger(__name__)


TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)  # seconds


@dataclass
class Durations:
    """Seconds observed, kept as a Prometheus histogram keeps them (a count per bucket, the total), not one by one:
    a server runs for months."""

    bounds: tuple[float, ...] = TRANSFER_BUCKETS
    counts: list[int] = field(init=False)  # observations <= each bound
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.bounds)

    def observe(self, seconds: float) -> None:
        for i, bound in enumerate(self.bounds):
            if seconds <= bound:
                self.counts[i] += 1
        self.total += seconds
        self.count += 1


@dataclass
class KVTransferStats:
    """What this server shipped and received (the /metrics counters)."""

    sent_tokens: int = 0  # tokens whose KV was handed to the transport
    sent_bytes: int = 0
    sent_transfers: int = 0
    send_failures: int = 0
    received_tokens: int = 0  # tokens whose KV arrived (those this cache held already included)
    received_bytes: int = 0
    received_transfers: int = 0
    refused_transfers: int = 0  # of another layout, cut, or with no room
    expired_transfers: int = 0  # received, never claimed
    send_seconds: Durations = field(default_factory=Durations)  # export and send, per transfer
    import_seconds: Durations = field(default_factory=Durations)  # into the pool, per transfer


@dataclass(frozen=True)
class TransferParams:
    """A request's `kv_transfer_params`, checked."""

    transfer_id: str
    remote_decode: bool = False
    remote_prefill: bool = False
    remote_host: str | None = None
    remote_port: int | None = None

    @classmethod
    def parse(cls, params: dict[str, Any]) -> "TransferParams":
        """ValueError naming what is missing or wrong."""
        if not isinstance(params, dict):
            raise ValueError("kv_transfer_params must be an object")
        transfer_id = params.get("transfer_id")
        if not isinstance(transfer_id, str) or not transfer_id:
            raise ValueError("kv_transfer_params.transfer_id must be a non-empty string")
        decode, prefill = bool(params.get("do_remote_decode")), bool(params.get("do_remote_prefill"))
        if decode == prefill:
            raise ValueError("kv_transfer_params must set exactly one of do_remote_decode and do_remote_prefill")
        host, port = params.get("remote_host"), params.get("remote_port")
        if decode and (not isinstance(host, str) or isinstance(port, bool) or not isinstance(port, int)):
            raise ValueError("kv_transfer_params with do_remote_decode need remote_host and remote_port (where the "
                             "consumer receives)")
        return cls(transfer_id, decode, prefill, host, port)


class KVTransferAgent:
    """Ships and receives for one engine, as its config's role allows (module docstring)."""

    def __init__(self, engine: LLMEngine, config: KVTransferConfig) -> None:
        engine.check_kv_transfer()
        self.engine, self.config = engine, config
        self.sender = KVSender() if config.is_producer else None
        self.receiver = KVReceiver(config.kv_ip, config.kv_port) if config.is_consumer else None
        self.stats = KVTransferStats()  # written under _stats_lock (the sender's thread writes too)
        self._stats_lock = threading.Lock()
        self._outgoing: dict[str, TransferParams] = {}  # request id -> where its prompt's blocks go
        self._arrived: dict[str, float] = {}  # transfer id -> when its blocks went into the pool (unclaimed)
        self._failed: set[str] = set()  # transfer ids whose blocks were refused: their requests compute
        self._claims: dict[str, str] = {}  # request id -> the transfer id whose blocks it holds

    def _count(self, **increments: int) -> None:
        """Add to the named counters, under the lock (the sender's thread counts too)."""
        with self._stats_lock:
            for name, amount in increments.items():
                setattr(self.stats, name, getattr(self.stats, name) + amount)

    def snapshot(self) -> KVTransferStats:
        """A copy of the counters, taken whole (for /metrics)."""
        with self._stats_lock:
            return copy.deepcopy(self.stats)

    @property
    def address(self) -> tuple[str, int] | None:
        """Where this server receives blocks (a consumer), for a router to tell producers."""
        return None if self.receiver is None else (self.receiver.host, self.receiver.port)

    def check_role(self, params: TransferParams) -> None:
        """ValueError when this server's role cannot serve a request with these params."""
        if params.remote_decode and self.sender is None:
            raise ValueError(f"this server is a {self.config.kv_role}: it does not ship KV (do_remote_decode)")
        if params.remote_prefill and self.receiver is None:
            raise ValueError(f"this server is a {self.config.kv_role}: it receives no KV (do_remote_prefill)")

    # ------------------------------------------------------------------ the consumer's side
    def ready(self, transfer_id: str) -> bool:
        """Whether a request waiting for `transfer_id`'s blocks may run now (they arrived, or were refused)."""
        return transfer_id in self._arrived or transfer_id in self._failed

    def claim(self, request_id: str, transfer_id: str) -> None:
        """The request now runs on `transfer_id`'s blocks (if they came): they are let go when it finishes."""
        self._failed.discard(transfer_id)
        if self._arrived.pop(transfer_id, None) is not None:
            self._claims[request_id] = transfer_id

    # ------------------------------------------------------------------ the producer's side
    def expect(self, request_id: str, params: TransferParams) -> None:
        """Ship this request's prompt blocks as `params` say once it finishes."""
        self._outgoing[request_id] = params

    # ------------------------------------------------------------------ on the step thread
    def before_step(self) -> None:
        """Take in every payload that arrived; let go of blocks unclaimed for longer than the timeout."""
        if self.receiver is not None:
            for received in self.receiver.take():
                self._take(received)
        deadline = time.monotonic() - self.config.kv_transfer_timeout_s
        for transfer_id in [t for t, when in self._arrived.items() if when < deadline]:
            del self._arrived[transfer_id]
            self.engine.release_import(transfer_id)
            self._count(expired_transfers=1)

    def _take(self, received: Any) -> None:
        payload = received.payload
        self._count(received_bytes=received.nbytes, refused_transfers=int(payload is None))
        if payload is None:
            return
        started = time.perf_counter()
        try:
            self.engine.import_prefix(payload)
        except ValueError as error:
            logger.warning("%s", error)
            self._count(refused_transfers=1)
            self._failed.add(payload.transfer_id)
            return
        with self._stats_lock:
            self.stats.import_seconds.observe(time.perf_counter() - started)
        self._count(received_transfers=1, received_tokens=payload.num_tokens)
        self._arrived[payload.transfer_id] = time.monotonic()

    def after_step(self, outputs: list[RequestOutput]) -> None:
        """Ship the prompts of producer requests that finished this step (their blocks are still cached: nothing
        has run since), and let go of the blocks of consumer requests that finished."""
        for output in outputs:
            if not output.finished:
                continue
            params = self._outgoing.pop(output.request_id, None)
            if params is not None:
                self._ship(output, params)
            transfer_id = self._claims.pop(output.request_id, None)
            if transfer_id is not None:
                self.engine.release_import(transfer_id)

    def forget(self, request_id: str) -> None:
        """An aborted request: nothing to ship for it, and its blocks go."""
        self._outgoing.pop(request_id, None)
        transfer_id = self._claims.pop(request_id, None)
        if transfer_id is not None:
            self.engine.release_import(transfer_id)

    def _ship(self, output: RequestOutput, params: TransferParams) -> None:
        """Read the prompt's blocks now (on the step thread, before anything can evict them), and hand them to the
        sender's thread: the next step does not wait for the network."""
        assert self.sender is not None and params.remote_host is not None and params.remote_port is not None
        started = time.perf_counter()
        try:
            payload = self.engine.export_prefix(output.prompt_token_ids, params.transfer_id)
        except Exception as error:  # never the step loop's end: the consumer computes the prompt itself instead
            logger.warning("reading KV %s failed: %s", params.transfer_id, error)
            self._count(send_failures=1)
            return
        exported = time.perf_counter() - started
        sending = self.sender.submit(payload, params.remote_host, params.remote_port)
        sent_at = time.perf_counter()

        def record(future: Future[int]) -> None:  # on the sender's thread (on this one for a payload it refused)
            error = RuntimeError("the sender closed") if future.cancelled() else future.exception()
            if error is not None:  # the consumer is gone: its request computes the prompt itself (or times out)
                logger.warning("shipping KV %s failed: %s", params.transfer_id, error)
                self._count(send_failures=1)
                return
            with self._stats_lock:
                self.stats.send_seconds.observe(exported + time.perf_counter() - sent_at)
            self._count(sent_transfers=1, sent_tokens=payload.num_tokens, sent_bytes=future.result())

        sending.add_done_callback(record)

    def close(self) -> None:
        for end in (self.sender, self.receiver):
            if end is not None:
                end.close()
