"""The KV transport between servers: ZeroMQ messages over TCP (lesson 18).

A consumer binds one PULL socket (`KVReceiver`); any producer connects a PUSH socket to it (`KVSender`) and sends
each payload as one multipart message: its JSON header and two large frames of key and value bytes
(payload.py), and a MAC frame where the servers share a secret (trust.py). Why ZeroMQ, not torch.distributed's
point-to-point sends over gloo: a process group is a fixed set of ranks that must all start together and agree on
every send's partner and tag, while servers come and go and any prefill server may ship to any decode server;
ZeroMQ connects any sender to a listening receiver at any time, reconnects by itself, frames messages (no length
prefixes to write by hand), and sends the tensors' buffers without copying them into Python bytes. (vLLM's P2P
connectors use ZeroMQ the same way, for their control messages, with NCCL for GPU tensors.)

The receiving end faces the network, so it takes nothing on trust and lets nothing stop it:

- with a secret, the socket takes only CURVE connections from peers that know it (trust.curve_keys), and with
  `trusted_peers` only connections from those addresses (ZeroMQ's ZAP handler): a peer outside them never
  completes the handshake, so it cannot make the receiver buffer anything (a ZeroMQ message is delivered whole,
  however many frames it has: only the handshake stops a stranger's);
- ZeroMQ drops a peer that sends a frame over `max_frame_bytes` (MAXMSGSIZE: the largest a payload of the
  receiver's context can be) before the receiver reads a byte of it, and queues at most a few messages
  (RCVHWM), so a sender that outruns the engine waits instead of filling memory;
- a message without a valid, fresh, unseen MAC where there is a secret, or whose frames are not a payload
  (payload.py checks every field) is refused and counted (`num_refused`), and the thread goes on: no message,
  however malformed, and no error of the thread's own, ends it;
- received payloads wait in a bounded inbox (`max_inbox_bytes`, `max_inbox_messages`); when it is full the
  thread stops reading, and ZeroMQ's queue and then the sender's timeout push back.

Threads: a receiver's socket is read by its own thread, which puts each accepted payload in the inbox and calls
`on_message` (the server wakes its loop, which takes the payloads between steps: the block manager is that
thread's alone). A sender ships on one thread per receiving address (a "lane"), so a receiver that is gone costs
its own lane one timeout, never the other consumers' transfers; the engine's thread hands a payload over and goes
on with its next step.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import zmq

from .log_throttle import LogThrottle
from .payload import KVPayload, read_header
from .trust import MAC_BYTES, FrameSigner, curve_keys, fresh

logger = logging.getLogger(__name__)
SEND_TIMEOUT_MS = 2_000  # a receiver that takes nothing for this long fails the send (it is gone or stuck)
SEND_HIGH_WATER_MARK = 4  # messages queued for one receiver before a send waits
RECEIVE_HIGH_WATER_MARK = 2  # messages ZeroMQ queues for the receiver's thread before senders wait
DEAD_FOR_S = 10.0  # how long an address whose receiver timed out fails sends at once
MAX_PENDING_BYTES = 1 << 30  # payload bytes waiting for the sender's lanes before more are refused
MAX_LANES = 16  # receiving addresses a sender keeps a socket and a thread for (the least recently used closed)
MAX_MESSAGE_AGE_S = 300.0  # a signed message sent longer ago than this is refused (a replay)
MAX_INBOX_MESSAGES = 64  # payloads waiting for the engine's thread, whatever their size
MAX_SEEN = 4096  # signed messages remembered (their MACs) to refuse a replay within MAX_MESSAGE_AGE_S
ZAP_DOMAIN = b"llm_runtime-kv"


@dataclass(frozen=True)
class Received:
    """A payload off the wire, its size and when it came."""

    payload: KVPayload
    nbytes: int
    received_at: float  # time.monotonic()


class KVReceiver:
    """A PULL socket bound at host:port (port 0: any free one; `port` then says which), read by a thread that
    refuses what is not a trusted payload (module docstring)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, secret: str | None = None,
                 trusted_peers: Collection[str] | None = None, max_tokens: int | None = None,
                 max_frame_bytes: int = 1 << 30, max_inbox_bytes: int = 1 << 30,
                 on_message: Callable[[], None] | None = None) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.PULL)
        self.socket.setsockopt(zmq.LINGER, 0)
        # Before bind: these apply to every connection the socket accepts.
        self.socket.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        self.socket.setsockopt(zmq.RCVHWM, RECEIVE_HIGH_WATER_MARK)
        self.authenticator = None
        if trusted_peers is not None:  # ZeroMQ asks this handler about every connection, before a message comes
            from zmq.auth.thread import ThreadAuthenticator

            self.authenticator = ThreadAuthenticator(self.context)
            self.authenticator.start()
            self.authenticator.allow(*trusted_peers)
            if secret is not None:
                self.authenticator.configure_curve(domain="*", location=zmq.auth.CURVE_ALLOW_ANY)
            self.socket.zap_domain = ZAP_DOMAIN
        if secret is not None:
            public, private = curve_keys(secret, "receiver")
            self.socket.curve_server = True
            self.socket.curve_publickey, self.socket.curve_secretkey = public, private
        if port == 0:
            port = self.socket.bind_to_random_port(f"tcp://{host}")
        else:
            self.socket.bind(f"tcp://{host}:{port}")
        self.host, self.port = host, port
        self.signer = FrameSigner(secret) if secret is not None else None
        self.trusted_peers = None if trusted_peers is None else frozenset(trusted_peers)
        self.max_tokens, self.max_inbox_bytes = max_tokens, max_inbox_bytes
        self.on_message = on_message
        self._inbox: collections.deque[Received] = collections.deque()
        self._inbox_bytes = 0
        self._room = threading.Condition()
        self._seen: collections.OrderedDict[bytes, float] = collections.OrderedDict()  # MACs taken, and when
        self.num_refused = self.refused_bytes = 0  # messages refused (any reason), written under _room
        self.last_refusal: str | None = None
        self._refusals_log = LogThrottle(logger)  # a flood of refusals is not a flood of log lines
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-receiver-{port}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        while not self._stopping.is_set():
            try:
                if not poller.poll(timeout=100):
                    continue
                frames = self.socket.recv_multipart(copy=False)
            except zmq.ZMQError as error:  # the socket or its context closed under the thread
                if self._stopping.is_set() or error.errno == zmq.ETERM:
                    return
                logger.exception("the KV receiver's socket failed; reading on")
                continue
            except Exception:  # noqa: BLE001 - (MemoryError, ...) never the thread's end
                logger.exception("receiving a KV message failed; reading on")
                continue
            try:
                nbytes = sum(len(frame.buffer) for frame in frames)
                payload = self._accept(frames)
            except Exception as error:  # noqa: BLE001 - whatever a message holds, it refuses that message only
                self._refuse(sum(len(frame.buffer) for frame in frames), f"{type(error).__name__}: {error}")
                continue
            self._put(Received(payload, nbytes, time.monotonic()))

    def _accept(self, frames: list[zmq.Frame]) -> KVPayload:
        """The payload these frames carry, if they come from a trusted peer and carry one; else ValueError."""
        if self.trusted_peers is not None:
            peer = frames[0].get("Peer-Address")
            if peer not in self.trusted_peers:
                raise ValueError(f"a KV message from {peer}, which is not a trusted producer")
        buffers = [frame.buffer for frame in frames]
        if self.signer is not None:  # the MAC before anything is parsed: only a key holder's bytes get further
            if len(buffers) != 4 or memoryview(buffers[3]).nbytes != MAC_BYTES:
                raise ValueError("a KV message without its MAC (this receiver shares a secret with its producers)")
            if not self.signer.verify(buffers[:3], buffers[3]):
                raise ValueError("a KV message whose MAC is wrong (another secret, or altered on the way)")
            mac, buffers = bytes(buffers[3]), buffers[:3]
            sent_at = read_header(buffers[0], self.max_tokens or 1).get("sent_at")
            if not fresh(sent_at, MAX_MESSAGE_AGE_S):
                raise ValueError(f"a KV message sent at {sent_at!r}: too old, or from the future (a replay?)")
            self._remember(mac)
        return KVPayload.from_frames(buffers, self.max_tokens)

    def _remember(self, mac: bytes) -> None:
        """ValueError for a signed message taken before (a replay within its freshness); else note it."""
        now = time.monotonic()
        while self._seen and (next(iter(self._seen.values())) < now - MAX_MESSAGE_AGE_S or len(self._seen) >= MAX_SEEN):
            self._seen.popitem(last=False)
        if mac in self._seen:
            raise ValueError("a KV message taken before, sent again (a replay)")
        self._seen[mac] = now

    def _refuse(self, nbytes: int, why: str) -> None:
        self._refusals_log.warning("refused a KV message of %d bytes: %s", nbytes, why)
        with self._room:
            self.num_refused += 1
            self.refused_bytes += nbytes
            self.last_refusal = why

    def _put(self, received: Received) -> None:
        """Into the inbox, waiting while it is full (the engine takes what is there between steps)."""
        with self._room:
            while self._inbox and (self._inbox_bytes + received.nbytes > self.max_inbox_bytes
                                   or len(self._inbox) >= MAX_INBOX_MESSAGES):
                if self._stopping.is_set():
                    return
                self._room.wait(timeout=0.1)
            self._inbox.append(received)
            self._inbox_bytes += received.nbytes
            self._room.notify_all()  # (a caller of `wait`)
        if self.on_message is not None:
            try:
                self.on_message()
            except Exception:  # noqa: BLE001 - a loop that is gone: the payload waits in the inbox
                logger.exception("waking the engine loop for a KV message failed")

    def take(self) -> list[Received]:
        """Every payload received since the last call."""
        with self._room:
            taken, self._inbox, self._inbox_bytes = list(self._inbox), collections.deque(), 0
            self._room.notify_all()
        return taken

    def wait(self, timeout_s: float = 60.0) -> Received:
        """The next payload received, waiting up to `timeout_s` for one (TimeoutError): for a caller that takes
        payloads one at a time (lesson 18), where a server takes them all between steps (`take`)."""
        deadline = time.monotonic() + timeout_s
        with self._room:
            while not self._inbox:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"no KV payload arrived within {timeout_s:g} s")
                self._room.wait(remaining)
            received = self._inbox.popleft()
            self._inbox_bytes -= received.nbytes
            self._room.notify_all()
        return received

    @property
    def num_waiting(self) -> int:
        """Payloads in the inbox now."""
        with self._room:
            return len(self._inbox)

    def close(self) -> None:
        self._stopping.set()
        with self._room:
            self._room.notify_all()
        self._thread.join(timeout=5)
        if self._thread.is_alive():  # (stuck past its polls: leave its socket to it rather than close it under it)
            logger.error("the KV receiver's thread did not stop; its socket is left open")
            return
        self.socket.close()
        if self.authenticator is not None:
            self.authenticator.stop()
        self.context.term()


class _Lane:
    """One receiving address's socket, used only by the lane's own thread."""

    def __init__(self, context: zmq.Context, address: str, keys: tuple[bytes, bytes, bytes] | None) -> None:
        self.address = address
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-sender")
        self.socket: zmq.Socket | None = None
        self.context = context
        self.keys = keys  # CURVE: the receiver's public key, and this sender's pair (trust.curve_keys)
        self.pending = 0  # payloads handed to this lane and not yet sent or failed (the sender's lock guards it)
        self.dead_until = 0.0  # until when sends to this address fail at once (the lane's thread writes it)

    def send(self, frames: list, timeout_ms: int) -> int:
        if time.monotonic() < self.dead_until:
            raise RuntimeError(f"the KV receiver at {self.address} took nothing for {timeout_ms / 1e3:.0f} s a "
                               f"moment ago: taken for gone")
        if self.socket is None:
            self.socket = self.context.socket(zmq.PUSH)
            self.socket.setsockopt(zmq.LINGER, 0)
            self.socket.setsockopt(zmq.SNDTIMEO, timeout_ms)
            self.socket.setsockopt(zmq.SNDHWM, SEND_HIGH_WATER_MARK)
            self.socket.setsockopt(zmq.IMMEDIATE, 1)  # queue only for a receiver that is connected, not a dead one
            if self.keys is not None:
                self.socket.curve_serverkey, self.socket.curve_publickey, self.socket.curve_secretkey = self.keys
            self.socket.connect(self.address)
        try:
            self.socket.send_multipart(frames, copy=False)
        except zmq.Again as error:
            self.dead_until = time.monotonic() + DEAD_FOR_S
            self.socket.close()  # a dead receiver's socket is not kept (it is made again after DEAD_FOR_S)
            self.socket = None
            raise RuntimeError(f"the KV receiver at {self.address} took nothing for {timeout_ms / 1e3:.0f} s") \
                from error
        self.dead_until = 0.0
        return sum(memoryview(frame).nbytes for frame in frames)

    def close(self, cancel: bool = True) -> None:
        """Stop the lane's thread (what it was sending finishes or times out first, and with `cancel` what waits is
        dropped), then close its socket."""
        self.executor.shutdown(wait=True, cancel_futures=cancel)
        if self.socket is not None:
            self.socket.close()
            self.socket = None


class KVSender:
    """Ships payloads to receivers, one lane (a thread and a PUSH socket) per address, at most MAX_LANES of them.

    `submit` queues a payload and returns at once, so an engine's step thread never waits on the network; `send`
    waits for its own message. "Sent" means handed to ZeroMQ, which delivers it in the background (at most
    SEND_HIGH_WATER_MARK messages wait per receiver). A receiver that takes nothing for SEND_TIMEOUT_MS fails the
    send, its socket is closed, and its address then fails at once for DEAD_FOR_S, so one dead consumer holds up
    its own lane for one timeout, not one per payload, and nobody else's. Past MAX_LANES addresses, the least
    recently used idle lane is retired (one with payloads still to send never is: a new address is refused
    instead). Payloads waiting in the lanes hold at most MAX_PENDING_BYTES (beyond, a payload is refused at
    once). With a `secret`, every connection is CURVE's and every message carries its MAC (trust.py)."""

    def __init__(self, secret: str | None = None) -> None:
        self.context = zmq.Context()
        self.signer = FrameSigner(secret) if secret is not None else None
        self.keys = None if secret is None else (curve_keys(secret, "receiver")[0], *curve_keys(secret, "sender"))
        self._lanes: collections.OrderedDict[str, _Lane] = collections.OrderedDict()
        self._pending_bytes = 0
        self._lock = threading.Lock()
        self._closed = False

    @property
    def num_lanes(self) -> int:
        with self._lock:
            return len(self._lanes)

    def submit(self, payload: KVPayload, host: str, port: int) -> "Future[int]":
        """Ship `payload` to the receiver at host:port on that address's lane; the future gives the bytes handed
        to ZeroMQ, or RuntimeError when the receiver took nothing in time or too much already waits."""
        size = payload.keys.nbytes + payload.values.nbytes
        address = f"tcp://{host}:{port}"
        retired: _Lane | None = None
        with self._lock:
            refusal = ("the sender is closed" if self._closed else
                       f"{self._pending_bytes:,} bytes of KV already wait to be sent"
                       if self._pending_bytes and self._pending_bytes + size > MAX_PENDING_BYTES else None)
            lane = self._lanes.get(address)
            if refusal is None and lane is None:
                if len(self._lanes) >= MAX_LANES:
                    idle = next((a for a, existing in self._lanes.items() if existing.pending == 0), None)
                    if idle is None:
                        refusal = f"{MAX_LANES} receivers' lanes are busy sending"
                    else:
                        retired = self._lanes.pop(idle)
                if refusal is None:
                    lane = self._lanes[address] = _Lane(self.context, address, self.keys)
            if refusal is not None:
                refused: Future[int] = Future()
                refused.set_exception(RuntimeError(refusal))
                return refused
            assert lane is not None
            self._lanes.move_to_end(address)
            self._pending_bytes += size
            lane.pending += 1
            future = lane.executor.submit(self._send, lane, payload)
        future.add_done_callback(lambda _: self._done(lane, size))
        if retired is not None:  # idle: its thread ends and its socket closes (not on this thread)
            threading.Thread(target=retired.close, name="kv-sender-retire", daemon=True).start()
        return future

    def send(self, payload: KVPayload, host: str, port: int) -> int:
        """`submit`, then wait: the bytes handed to ZeroMQ (RuntimeError as `submit` says)."""
        return self.submit(payload, host, port).result()

    def _done(self, lane: _Lane, size: int) -> None:
        with self._lock:
            self._pending_bytes -= size
            lane.pending -= 1

    def _send(self, lane: _Lane, payload: KVPayload) -> int:
        frames = payload.to_frames()
        if self.signer is not None:
            frames.append(self.signer.mac(frames))
        return lane.send(frames, SEND_TIMEOUT_MS)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            lanes, self._lanes = list(self._lanes.values()), collections.OrderedDict()
        for lane in lanes:
            lane.close()
        self.context.term()
