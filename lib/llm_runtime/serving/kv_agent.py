"""A server's part in KV transfer (lesson 18), between the async engine and the transport.

A request's `kv_transfer_params` (vLLM's name; the router sets them) say what to do with it:

- `{"do_remote_decode": true, "transfer_id": ..., "remote_host": ..., "remote_port": ...}` on a producer: compute
  the prompt (the router asks for one token), and when the request finishes, ship its prompt's blocks to the
  consumer at remote_host:remote_port, named by transfer_id;
- `{"do_remote_prefill": true, "transfer_id": ...}` on a consumer: wait until the blocks named transfer_id have
  arrived (at most `kv_transfer_timeout_s`; then compute the prompt here), then run the request, whose prompt
  finds them in the prefix cache; when it finishes, let them go.

They come in a public request body, so they are checked like everything a client sends (`TransferParams.parse`,
trust.py): a producer ships only where the router's signature, its own configuration or the loopback rule allow,
and a request claims blocks only when the router signed its params or the blocks hold its own prompt's first
tokens (`claim`). Received blocks no request claims within the timeout are let go, those of a request the
server refused (busy) at once (`discard`); while the server is overloaded, arriving blocks are refused instead of
pinned (`before_step(admit=False)`), and unclaimed blocks may hold at most half the pool.

Every method that touches the engine runs between steps: on the step thread around a step (`before_step`,
`after_step`), or on the event loop's thread while no step runs (`forget`, `discard`, as the async engine applies
aborts); never during a step. The sender's lanes only ship what `after_step` read, and count it: the counters are
written under a lock and read as a `snapshot()`.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from ..engine.engine import LLMEngine
from ..engine.outputs import RequestOutput
from ..errors import is_device_fault
from ..kv_transfer.config import KVTransferConfig
from ..kv_transfer.log_throttle import LogThrottle
from ..kv_transfer.payload import check_transfer_id
from ..kv_transfer.trust import is_loopback, signed_by
from ..kv_transfer.zmq_connector import KVReceiver, KVSender, Received

logger = logging.getLogger(__name__)


TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)  # seconds
MAX_UNCLAIMED_SHARE = 0.5  # of the pool's blocks, at most this many may wait for their requests at once
MAX_REMEMBERED = 4096  # transfer ids remembered as refused or unwanted (the oldest forgotten first)


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
    refused_transfers: int = 0  # untrusted, malformed, of another layout, with no room, or while overloaded
    expired_transfers: int = 0  # received, never claimed
    send_seconds: Durations = field(default_factory=Durations)  # export and send, per transfer
    import_seconds: Durations = field(default_factory=Durations)  # into the pool, per transfer


@dataclass(frozen=True)
class TransferParams:
    """A request's `kv_transfer_params`, checked; `signed`: the router signed them with the shared secret."""

    transfer_id: str
    remote_decode: bool = False
    remote_prefill: bool = False
    remote_host: str | None = None
    remote_port: int | None = None
    signed: bool = False

    @classmethod
    def parse(cls, params: dict[str, Any], config: KVTransferConfig | None = None) -> "TransferParams":
        """ValueError naming what is missing, wrong or not trusted (`config`: whose secret and peers count; none:
        the defaults, no secret)."""
        config = config or KVTransferConfig()
        if not isinstance(params, dict):
            raise ValueError("kv_transfer_params must be an object")
        unknown = sorted(set(params) - _PARAM_NAMES)
        if unknown:
            raise ValueError(f"kv_transfer_params has an unknown field {unknown[0]!r}")
        transfer_id = params.get("transfer_id")
        if not isinstance(transfer_id, str) or not transfer_id:
            raise ValueError("kv_transfer_params.transfer_id must be a non-empty string")
        check_transfer_id(transfer_id)
        decode, prefill = params.get("do_remote_decode"), params.get("do_remote_prefill")
        if any(value is not None and not isinstance(value, bool) for value in (decode, prefill)):
            raise ValueError("kv_transfer_params.do_remote_decode and do_remote_prefill must be true or false")
        if bool(decode) == bool(prefill):
            raise ValueError("kv_transfer_params must set exactly one of do_remote_decode and do_remote_prefill")
        host, port = params.get("remote_host"), params.get("remote_port")
        if decode and (not isinstance(host, str) or not host or isinstance(port, bool) or not isinstance(port, int)
                       or not 0 < port < 65536):
            raise ValueError("kv_transfer_params with do_remote_decode need remote_host and remote_port (where the "
                             "consumer receives)")
        signed = signed_by(config.kv_secret, params)
        if config.kv_secret is not None and not signed:
            raise ValueError("kv_transfer_params must carry the router's signature (this server shares a KV secret "
                             "with it): send the request through the router")
        if decode and not signed and f"{host}:{port}" not in config.kv_consumers and not is_loopback(host):
            raise ValueError(f"kv_transfer_params name {host}:{port}, which is not a KV consumer this server trusts "
                             f"(loopback, its kv_consumers, or signed by the router)")
        return cls(transfer_id, bool(decode), bool(prefill), host if decode else None, port if decode else None,
                   signed)


_PARAM_NAMES = {"transfer_id", "do_remote_decode", "do_remote_prefill", "remote_host", "remote_port", "expires",
                "signature"}


@dataclass
class _Arrival:
    """Blocks that arrived for a transfer, not yet claimed: when, and the tokens they hold."""

    at: float  # time.monotonic()
    token_ids: list[int]
    num_blocks: int


class KVTransferAgent:
    """Ships and receives for one engine, as its config's role allows (module docstring). `on_message`: called on
    the receiver's thread when a payload is waiting (the server wakes its loop with it)."""

    def __init__(self, engine: LLMEngine, config: KVTransferConfig,
                 on_message: Callable[[], None] | None = None) -> None:
        engine.check_kv_transfer()
        self.engine, self.config = engine, config
        self.sender = KVSender(config.kv_secret) if config.is_producer else None
        self.receiver = None
        if config.is_consumer:
            blocks = -(-engine.max_model_len // engine.config.block_size)
            frame_bytes = engine.kv_cache.nbytes // (2 * engine.kv_cache.num_blocks) * blocks  # keys (or values)
            self.receiver = KVReceiver(config.kv_ip, config.kv_port, secret=config.kv_secret,
                                       trusted_peers=config.kv_trusted_producers, max_tokens=engine.max_model_len,
                                       max_frame_bytes=frame_bytes + 4096,
                                       max_inbox_bytes=max(engine.kv_cache.nbytes, 2 * frame_bytes + 8192),
                                       on_message=on_message)
        self.stats = KVTransferStats()  # written under _stats_lock (the sender's lanes write too)
        self._stats_lock = threading.Lock()
        self._outgoing: dict[str, TransferParams] = {}  # request id -> where its prompt's blocks go
        self._arrived: dict[str, _Arrival] = {}  # transfer id -> its blocks, in the pool and unclaimed
        self._unclaimed_blocks = 0  # the blocks of `_arrived`, summed
        self._failed: OrderedDict[str, float] = OrderedDict()  # transfer id -> when its blocks were refused
        self._unwanted: OrderedDict[str, float] = OrderedDict()  # transfer ids whose request was refused
        self._claims: dict[str, str] = {}  # request id -> the transfer id whose blocks it holds
        self._refusals_log = LogThrottle(logger)  # a peer can make payloads refused at any rate

    def _count(self, **increments: int) -> None:
        """Add to the named counters, under the lock (the sender's lanes count too)."""
        with self._stats_lock:
            for name, amount in increments.items():
                setattr(self.stats, name, getattr(self.stats, name) + amount)

    def snapshot(self) -> KVTransferStats:
        """A copy of the counters, taken whole (for /metrics), with the messages the receiver refused."""
        with self._stats_lock:
            stats = copy.deepcopy(self.stats)
        if self.receiver is not None:
            stats.refused_transfers += self.receiver.num_refused
            stats.received_bytes += self.receiver.refused_bytes
        return stats

    @property
    def address(self) -> tuple[str, int] | None:
        """Where this server receives blocks (a consumer), for a router to tell producers."""
        return None if self.receiver is None else (self.receiver.host, self.receiver.port)

    def parse(self, params: dict[str, Any]) -> TransferParams:
        """A request's kv_transfer_params, checked against this server's role and trust (ValueError saying why)."""
        parsed = TransferParams.parse(params, self.config)
        if parsed.remote_decode and self.sender is None:
            raise ValueError(f"this server is a {self.config.kv_role}: it does not ship KV (do_remote_decode)")
        if parsed.remote_prefill and self.receiver is None:
            raise ValueError(f"this server is a {self.config.kv_role}: it receives no KV (do_remote_prefill)")
        return parsed

    # ------------------------------------------------------------------ the consumer's side
    def ready(self, transfer_id: str) -> bool:
        """Whether a request waiting for `transfer_id`'s blocks may run now (they arrived, or were refused)."""
        return transfer_id in self._arrived or transfer_id in self._failed

    def claim(self, request_id: str, params: TransferParams, prompt_token_ids: list[int]) -> None:
        """The request now runs on `params.transfer_id`'s blocks, if they came and it may have them: the router
        signed its params, or the blocks hold its own prompt's first tokens (anything else would let a client
        release blocks meant for another request). They are let go when it finishes."""
        self._failed.pop(params.transfer_id, None)
        arrival = self._arrived.get(params.transfer_id)
        if arrival is None:
            return
        tokens = arrival.token_ids
        if not params.signed and prompt_token_ids[: len(tokens)] != tokens:
            logger.warning("request %s claims transfer %s, whose blocks hold another prompt; it computes its own",
                           request_id, params.transfer_id)
            return
        del self._arrived[params.transfer_id]
        self._unclaimed_blocks -= arrival.num_blocks
        self._claims[request_id] = params.transfer_id

    def discard(self, transfer_id: str) -> None:
        """The request that would claim `transfer_id` was refused (busy): its blocks go now, or as they arrive."""
        if transfer_id in self._arrived:
            self._let_go(transfer_id)
        else:
            _remember(self._unwanted, transfer_id)

    def _let_go(self, transfer_id: str) -> None:
        """Unclaimed blocks go back to the cache (evictable), counted as expired."""
        self._unclaimed_blocks -= self._arrived.pop(transfer_id).num_blocks
        self.engine.release_import(transfer_id)
        self._count(expired_transfers=1)

    def seconds_to_next_expiry(self) -> float | None:
        """How long until unclaimed blocks or refusals are due to be let go (None: nothing waits to expire)."""
        times = [arrival.at for arrival in self._arrived.values()] + list(self._failed.values())[:1]
        if not times:
            return None
        return max(0.0, min(times) + self.config.kv_transfer_timeout_s - time.monotonic())

    # ------------------------------------------------------------------ the producer's side
    def expect(self, request_id: str, params: TransferParams) -> None:
        """Ship this request's prompt blocks as `params` say once it finishes."""
        self._outgoing[request_id] = params

    # ------------------------------------------------------------------ on the step thread
    def before_step(self, admit: bool = True) -> None:
        """Take in every payload that arrived (refused while `admit` is False: the server is overloaded, and
        blocks no request may claim soon would only take room); let go of what waited longer than the timeout."""
        if self.receiver is not None:
            for received in self.receiver.take():
                self._take(received, admit)
        deadline = time.monotonic() - self.config.kv_transfer_timeout_s
        for transfer_id in [t for t, arrival in self._arrived.items() if arrival.at < deadline]:
            self._let_go(transfer_id)
        for table in (self._failed, self._unwanted):
            while table and next(iter(table.values())) < deadline:
                table.popitem(last=False)

    def _take(self, received: Received, admit: bool) -> None:
        payload = received.payload
        transfer_id = payload.transfer_id
        self._count(received_bytes=received.nbytes)
        refusal = None
        if not admit:
            refusal = "the server is overloaded"
        elif payload.num_blocks == 0:
            refusal = "it holds no block"
        elif transfer_id in self._unwanted:
            refusal = "its request was refused already"
        elif transfer_id in self._arrived or transfer_id in self._claims.values():
            refusal = "blocks of this transfer arrived already"
        elif self._unclaimed_blocks + payload.num_blocks > \
                MAX_UNCLAIMED_SHARE * self.engine.block_manager.num_total_blocks:
            refusal = "unclaimed blocks hold their share of the pool already"
        if refusal is None:
            started = time.perf_counter()
            try:
                self.engine.import_prefix(payload)
            except Exception as error:  # noqa: BLE001 - a payload refused, never the loop's end
                if is_device_fault(error):
                    raise
                refusal = str(error)
            else:
                with self._stats_lock:
                    self.stats.import_seconds.observe(time.perf_counter() - started)
                self._count(received_transfers=1, received_tokens=payload.num_tokens)
                self._arrived[transfer_id] = _Arrival(time.monotonic(), payload.token_ids, payload.num_blocks)
                self._unclaimed_blocks += payload.num_blocks
                return
        self._refusals_log.warning("refused KV transfer %r: %s", transfer_id, refusal)
        self._count(refused_transfers=1)
        self._unwanted.pop(transfer_id, None)
        _remember(self._failed, transfer_id)

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
        """An aborted request (or one that never joined): nothing to ship for it, and its blocks go."""
        self._outgoing.pop(request_id, None)
        transfer_id = self._claims.pop(request_id, None)
        if transfer_id is not None:
            self.engine.release_import(transfer_id)

    def _ship(self, output: RequestOutput, params: TransferParams) -> None:
        """Read the prompt's blocks now (on the step thread, before anything can evict them), and hand them to the
        sender's lane: the next step does not wait for the network."""
        assert self.sender is not None and params.remote_host is not None and params.remote_port is not None
        started = time.perf_counter()
        try:
            payload = self.engine.export_prefix(output.prompt_token_ids, params.transfer_id)
        except Exception as error:  # never the step loop's end: the consumer computes the prompt itself instead
            if is_device_fault(error):
                raise
            logger.warning("reading KV %s failed: %s", params.transfer_id, error)
            self._count(send_failures=1)
            return
        exported = time.perf_counter() - started
        sending = self.sender.submit(payload, params.remote_host, params.remote_port)
        sent_at = time.perf_counter()

        def record(future: Future[int]) -> None:  # on the lane's thread (on this one for a payload it refused)
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


def _remember(table: OrderedDict[str, float], transfer_id: str) -> None:
    """Note `transfer_id` in a bounded table of recent ones (its oldest entries forgotten first)."""
    table[transfer_id] = time.monotonic()
    table.move_to_end(transfer_id)
    while len(table) > MAX_REMEMBERED:
        table.popitem(last=False)
