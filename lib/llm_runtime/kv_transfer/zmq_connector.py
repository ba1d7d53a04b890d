"""The KV transport between servers: ZeroMQ messages over TCP (lesson 18).

A consumer binds one PULL socket (`KVReceiver`); any producer connects a PUSH socket to it (`KVSender`) and sends
each payload as one multipart message: its JSON header and two large frames of key and value bytes
(payload.py). Why ZeroMQ, not torch.distributed's point-to-point sends over gloo: a process group is a fixed set
of ranks that must all start together and agree on every send's partner and tag, while servers come and go and
any prefill server may ship to any decode server; ZeroMQ connects any sender to a listening receiver at any time,
reconnects by itself, frames messages (no length prefixes to write by hand), and sends the tensors' buffers
without copying them into Python bytes. (vLLM's P2P connectors use ZeroMQ the same way, for
their control messages, with NCCL for GPU tensors.)

Threads: a receiver's socket is read by its own thread, which parses each message and puts the payload, or the
reason it was refused, in `inbox`; the engine's thread takes them from there between steps (the block manager is
that thread's alone). A sender's sockets are used by a thread of the sender's own, so the engine's thread hands
it a payload and goes on with its next step.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import zmq

from .payload import KVPayload

logger = logging.getLogger(__name__)
SEND_TIMEOUT_MS = 2_000  # a receiver that takes nothing for this long fails the send (it is gone or stuck)
SEND_HIGH_WATER_MARK = 4  # messages queued for one receiver before a send waits
DEAD_FOR_S = 10.0  # how long an address whose receiver timed out fails sends at once
MAX_PENDING_BYTES = 1 << 30  # payload bytes waiting for the sender's thread before more are refused


@dataclass(frozen=True)
class Received:
    """A message off the wire: its payload (None when refused: then `error` says why), its size, when it came."""

    payload: KVPayload | None
    nbytes: int
    received_at: float  # time.monotonic()
    error: str | None = None


class KVReceiver:
    """A PULL socket bound at host:port (port 0: any free one; `port` then says which), read by a thread."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.PULL)
        self.socket.setsockopt(zmq.LINGER, 0)
        if port == 0:
            port = self.socket.bind_to_random_port(f"tcp://{host}")
        else:
            self.socket.bind(f"tcp://{host}:{port}")
        self.host, self.port = host, port
        self.inbox: queue.Queue[Received] = queue.Queue()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-receiver-{port}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        while not self._stopping.is_set():
            if not poller.poll(timeout=100):
                continue
            frames = self.socket.recv_multipart(copy=False)
            nbytes = sum(len(frame.buffer) for frame in frames)
            try:
                payload = KVPayload.from_frames([frame.buffer for frame in frames])
            except ValueError as error:
                logger.warning("refused a KV message of %d bytes: %s", nbytes, error)
                self.inbox.put(Received(None, nbytes, time.monotonic(), str(error)))
                continue
            self.inbox.put(Received(payload, nbytes, time.monotonic()))

    def take(self) -> list[Received]:
        """Every message received since the last call."""
        out = []
        while True:
            try:
                out.append(self.inbox.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=5)
        self.socket.close()
        self.context.term()


class KVSender:
    """PUSH sockets, one per receiver address, made on first use and used only by the sender's own thread.

    `submit` queues a payload and returns at once, so an engine's step thread never waits on the network; `send`
    waits for its own message. "Sent" means handed to ZeroMQ, which delivers it in the background (at most
    SEND_HIGH_WATER_MARK messages wait per receiver). A receiver that takes nothing for SEND_TIMEOUT_MS fails the
    send, and its address then fails at once for DEAD_FOR_S, so one dead consumer holds the queue up for one
    timeout, not one per payload; payloads waiting in the queue hold at most MAX_PENDING_BYTES (beyond, a payload
    is refused at once), so a dead consumer costs neither the engine's steps nor unbounded memory."""

    def __init__(self) -> None:
        self.context = zmq.Context()
        self.sockets: dict[str, zmq.Socket] = {}
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-sender")
        self._pending_bytes = 0
        self._lock = threading.Lock()
        self._dead_until: dict[str, float] = {}  # address -> until when sends to it fail at once (sender's thread)

    def submit(self, payload: KVPayload, host: str, port: int) -> "Future[int]":
        """Ship `payload` to the receiver at host:port on the sender's thread; the future gives the bytes handed
        to ZeroMQ, or RuntimeError when the receiver took nothing in time or too much already waits."""
        size = payload.keys.nbytes + payload.values.nbytes
        with self._lock:
            if self._pending_bytes and self._pending_bytes + size > MAX_PENDING_BYTES:
                refused: Future[int] = Future()
                refused.set_exception(RuntimeError(f"{self._pending_bytes:,} bytes of KV already wait to be sent"))
                return refused
            self._pending_bytes += size
        future = self._thread.submit(self._send, payload, host, port)
        future.add_done_callback(lambda _: self._done(size))
        return future

    def send(self, payload: KVPayload, host: str, port: int) -> int:
        """`submit`, then wait: the bytes handed to ZeroMQ (RuntimeError as `submit` says)."""
        return self.submit(payload, host, port).result()

    def _done(self, size: int) -> None:
        with self._lock:
            self._pending_bytes -= size

    def _send(self, payload: KVPayload, host: str, port: int) -> int:
        address = f"tcp://{host}:{port}"
        if time.monotonic() < self._dead_until.get(address, 0.0):
            raise RuntimeError(f"the KV receiver at {address} took nothing for {SEND_TIMEOUT_MS / 1e3:.0f} s a "
                               f"moment ago: taken for gone")
        socket = self.sockets.get(address)
        if socket is None:
            socket = self.context.socket(zmq.PUSH)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
            socket.setsockopt(zmq.SNDHWM, SEND_HIGH_WATER_MARK)
            socket.setsockopt(zmq.IMMEDIATE, 1)  # queue only for a receiver that is connected, not for a dead one
            socket.connect(address)
            self.sockets[address] = socket
        frames = payload.to_frames()
        try:
            socket.send_multipart(frames, copy=False)
        except zmq.Again as error:
            self._dead_until[address] = time.monotonic() + DEAD_FOR_S
            raise RuntimeError(f"the KV receiver at {address} took nothing for {SEND_TIMEOUT_MS / 1e3:.0f} s") from error
        self._dead_until.pop(address, None)
        return sum(memoryview(frame).nbytes for frame in frames)

    def close(self) -> None:
        self._thread.shutdown(wait=True, cancel_futures=True)
        for socket in self.sockets.values():
            socket.close()
        self.sockets.clear()
        self.context.term()
