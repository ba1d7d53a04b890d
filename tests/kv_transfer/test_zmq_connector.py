"""The ZeroMQ transport (kv_transfer/zmq_connector.py): a payload crosses loopback whole; a sender hands its
payloads to a lane of their address; a receiver that is gone fails one send after the timeout and the next ones at
once, without holding up the sends to a live receiver; payloads past the byte budget are refused at once; lanes
are bounded; the transfer histograms keep counts, not values. The receiving end as a hostile peer meets it:
messages of every wrong shape, type and size, frames past MAXMSGSIZE, unsigned, wrongly signed, replayed and
untrusted messages are refused and counted (and logged at most once every few seconds), and after each one a
good payload still arrives; a full inbox pushes back on the sender instead of growing."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch

from llm_runtime.kv_transfer import zmq_connector
from llm_runtime.serving.kv_agent import Durations
from llm_runtime.kv_transfer.payload import KVLayout, KVPayload
from llm_runtime.kv_transfer.zmq_connector import KVReceiver, KVSender
from llm_runtime.distributed.launch import free_port


def _payload(transfer_id: str = "t") -> KVPayload:
    layout = KVLayout(model="m", num_layers=2, num_kv_heads=1, head_dim=4, block_size=2, dtype="float32",
                      storage="float32", kv_cache_dtype="auto")
    keys = torch.arange(2 * 3 * 2 * 1 * 4, dtype=torch.float32).reshape(2, 3, 2, 1, 4)  # (layers, blocks, block, heads, dim)
    return KVPayload(transfer_id, layout, list(range(6)), keys, -keys)


def test_a_payload_crosses_loopback_whole() -> None:
    receiver, sender = KVReceiver("127.0.0.1", 0), KVSender()
    try:
        payload = _payload()
        sent = sender.send(payload, receiver.host, receiver.port)
        deadline = time.monotonic() + 10
        arrived = []
        while not arrived and time.monotonic() < deadline:
            arrived = receiver.take()
            time.sleep(0.01)
        assert len(arrived) == 1 and arrived[0].nbytes == sent and receiver.num_refused == 0
        got = arrived[0].payload
        assert got.transfer_id == "t" and got.token_ids == payload.token_ids and got.layout == payload.layout
        assert torch.equal(got.keys, payload.keys) and torch.equal(got.values, payload.values)
    finally:
        sender.close()
        receiver.close()


def test_a_dead_receiver_fails_its_send_then_fails_fast_and_others_still_get_theirs(monkeypatch) -> None:
    monkeypatch.setattr(zmq_connector, "SEND_TIMEOUT_MS", 300)
    sender, receiver = KVSender(), KVReceiver("127.0.0.1", 0)
    dead = free_port()  # nobody listens there
    try:
        with pytest.raises(RuntimeError, match="took nothing for"):
            sender.submit(_payload("first"), "127.0.0.1", dead).result(timeout=30)
        with pytest.raises(RuntimeError, match="taken for gone"):  # no second timeout for the same address
            sender.submit(_payload("second"), "127.0.0.1", dead).result(timeout=30)
        assert sender.send(_payload("live"), receiver.host, receiver.port) > 0  # a live receiver is not held up
    finally:
        sender.close()
        receiver.close()


def test_payloads_beyond_the_byte_budget_are_refused_at_once(monkeypatch) -> None:
    sender = KVSender()
    size = _payload().keys.nbytes * 2
    monkeypatch.setattr(zmq_connector, "MAX_PENDING_BYTES", size + 1)  # room for one payload, not two
    release = threading.Event()
    monkeypatch.setattr(sender, "_send", lambda lane, payload: release.wait(30) and size)
    try:
        first = sender.submit(_payload("first"), "127.0.0.1", 1)
        refused = sender.submit(_payload("second"), "127.0.0.1", 1)
        with pytest.raises(RuntimeError, match="already wait"):
            refused.result(timeout=1)
        release.set()
        assert first.result(timeout=30) == size
        assert sender.submit(_payload("third"), "127.0.0.1", 1).result(timeout=30) == size  # room again
    finally:
        release.set()
        sender.close()


def test_durations_keep_bucket_counts() -> None:
    durations = Durations()
    for seconds in (0.0004, 0.003, 0.003, 2.0):
        durations.observe(seconds)
    assert durations.count == 4 and durations.total == pytest.approx(2.0064)
    counts = dict(zip(durations.bounds, durations.counts))
    assert counts[0.0005] == 1 and counts[0.0025] == 1 and counts[0.005] == 3 and counts[1.0] == 3


def _arrivals(receiver: KVReceiver, count: int = 1, timeout_s: float = 10.0) -> list:
    deadline, arrived = time.monotonic() + timeout_s, []
    while len(arrived) < count and time.monotonic() < deadline:
        arrived += receiver.take()
        time.sleep(0.005)
    return arrived


def _raw_sender(receiver: KVReceiver):
    import zmq

    context = zmq.Context.instance()
    socket = context.socket(zmq.PUSH)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(f"tcp://{receiver.host}:{receiver.port}")
    return socket


def _header(**changes) -> bytes:
    import json

    good = json.loads(bytes(_payload().to_frames()[0]))
    return json.dumps({**good, **changes}).encode()


def _hostile_messages() -> list[tuple[str, list[bytes]]]:
    frames = [bytes(f) for f in _payload().to_frames()]
    layout = dict(__import__("json").loads(frames[0])["layout"])
    return [
        ("no frames but one", frames[:1]),
        ("four frames, no secret", frames + [b"x" * 32]),
        ("not JSON", [b"\xff{", frames[1], frames[2]]),
        ("JSON, not an object", [b"[1, 2]", frames[1], frames[2]]),
        ("deep JSON", [b"[" * 100_000, frames[1], frames[2]]),
        ("block_size as a string", [_header(layout={**layout, "block_size": "2"}), frames[1], frames[2]]),
        ("a huge float token", [_header(token_ids=[1e999] * 6), frames[1], frames[2]]),
        ("a token id of 2**63", [_header(token_ids=[2**63] + list(range(5))), frames[1], frames[2]]),
        ("a negative token id", [_header(token_ids=[-1] + list(range(5))), frames[1], frames[2]]),
        ("booleans for sizes", [_header(layout={**layout, "num_layers": True}), frames[1], frames[2]]),
        ("a layout of a billion layers", [_header(layout={**layout, "num_layers": 10**9}), frames[1], frames[2]]),
        ("an unknown storage", [_header(layout={**layout, "storage": "complex128"}), frames[1], frames[2]]),
        ("an extra header field", [_header(extra=1), frames[1], frames[2]]),
        ("a transfer id that is a list", [_header(transfer_id=["t"]), frames[1], frames[2]]),
        ("a transfer id of 10,000 characters", [_header(transfer_id="t" * 10_000), frames[1], frames[2]]),
        ("frames cut short", [frames[0], frames[1][:-4], frames[2]]),
        ("tokens that are not whole blocks", [_header(token_ids=list(range(5))), frames[1], frames[2]]),
        ("a header of 100 million token ids", [b'{"token_ids": [' + b"1," * 100_000 + b"1]}", frames[1], frames[2]]),
    ]


def test_every_hostile_message_is_refused_and_the_receiver_lives_on(caplog) -> None:
    caplog.set_level("WARNING", logger=zmq_connector.__name__)
    receiver, sender = KVReceiver("127.0.0.1", 0, max_tokens=64), KVSender()
    socket = _raw_sender(receiver)
    try:
        for number, (what, frames) in enumerate(_hostile_messages(), start=1):
            socket.send_multipart(frames)
            sender.send(_payload(f"good-{number}"), receiver.host, receiver.port)
            arrived = _arrivals(receiver)
            assert [r.payload.transfer_id for r in arrived] == [f"good-{number}"], what
            assert receiver.num_refused == number, (what, receiver.last_refusal)
            assert receiver._thread.is_alive()
        logged = [r for r in caplog.records if r.name == zmq_connector.__name__]
        assert len(logged) == 1, "a flood of refusals is logged once every LogThrottle.every_s, not once each"
    finally:
        socket.close()
        sender.close()
        receiver.close()


def test_a_frame_past_the_size_limit_drops_its_peer_and_others_go_on() -> None:
    limit = 4096  # the header's room; the keys and values are smaller
    receiver, sender = KVReceiver("127.0.0.1", 0, max_frame_bytes=limit), KVSender()
    socket = _raw_sender(receiver)
    try:
        socket.send_multipart([b"{}", b"x" * (limit + 1), b"y"])  # ZeroMQ drops this peer, unread
        sender.send(_payload("after"), receiver.host, receiver.port)
        assert [r.payload.transfer_id for r in _arrivals(receiver)] == ["after"]
    finally:
        socket.close()
        sender.close()
        receiver.close()


def test_a_full_inbox_pushes_back_on_the_sender(monkeypatch) -> None:
    """Nobody takes from the inbox (a wedged engine): the receiver stops reading past its byte bound, ZeroMQ's and
    the kernel's queues fill, and the sender's sends time out; the inbox holds what it was allowed, and taking
    frees the way."""
    monkeypatch.setattr(zmq_connector, "SEND_TIMEOUT_MS", 500)
    layout = KVLayout(model="m", num_layers=2, num_kv_heads=4, head_dim=64, block_size=16, dtype="float32",
                      storage="float32", kv_cache_dtype="auto")
    keys = torch.zeros(2, 64, 16, 4, 64)  # 2 MiB each for keys and values

    def big(transfer_id: str) -> KVPayload:
        return KVPayload(transfer_id, layout, [1] * 1024, keys, keys)

    size = 2 * keys.nbytes
    receiver, sender = KVReceiver("127.0.0.1", 0, max_inbox_bytes=3 * size + 65536), KVSender()  # 3 and headers
    try:
        sent = 0
        with pytest.raises(RuntimeError, match="took nothing"):
            for i in range(64):  # 256 MiB: far more than the inbox, ZeroMQ and the kernel hold between them
                sender.send(big(f"p{i}"), receiver.host, receiver.port)
                sent += 1
        assert receiver.num_waiting == 3 and sent < 40
        assert len(_arrivals(receiver, 6)) >= 4  # taking frees the way: the thread reads on
    finally:
        sender.close()
        receiver.close()


def test_with_a_secret_only_its_holders_connect_and_only_signed_fresh_unseen_messages_get_in(monkeypatch) -> None:
    """With a secret the receiver takes CURVE connections from peers that know it: a sender without it, or with
    another, never completes the handshake (its sends time out; the receiver buffers nothing of theirs, not even
    a message of 10,000 frames). A holder's message still needs its MAC, fresh (not an hour old) and unseen (a
    replay of a taken message is refused), and unaltered."""
    import json

    import zmq

    from llm_runtime.kv_transfer.trust import FrameSigner, curve_keys

    monkeypatch.setattr(zmq_connector, "SEND_TIMEOUT_MS", 300)
    secret = "s3cret-shared-by-the-servers"
    receiver = KVReceiver("127.0.0.1", 0, secret=secret)
    signed, unsigned, wrong = KVSender(secret), KVSender(), KVSender("another-secret-of-16+")
    stranger = _raw_sender(receiver)
    holder = zmq.Context.instance().socket(zmq.PUSH)  # a raw socket that knows the secret's keys
    holder.setsockopt(zmq.LINGER, 0)
    holder.curve_serverkey = curve_keys(secret, "receiver")[0]
    holder.curve_publickey, holder.curve_secretkey = curve_keys(secret, "sender")
    holder.connect(f"tcp://{receiver.host}:{receiver.port}")
    try:
        for outsider in (unsigned, wrong):
            with pytest.raises(RuntimeError, match="took nothing"):
                outsider.send(_payload("outsider"), receiver.host, receiver.port)
        stranger.setsockopt(zmq.SNDTIMEO, 500)
        with contextlib.suppress(zmq.Again):  # (queued for a handshake that never completes, or not even that)
            stranger.send_multipart([b"x"] * 10_000)
        frames = [bytes(f) for f in _payload("old").to_frames()]
        header = json.loads(frames[0])
        frames[0] = json.dumps({**header, "sent_at": header["sent_at"] - 3600}).encode()  # an hour old
        holder.send_multipart(frames + [FrameSigner(secret).mac(frames)])
        altered = [bytes(f) for f in _payload("altered").to_frames()]
        mac = FrameSigner(secret).mac(altered)
        altered[1] = b"\x7f" + altered[1][1:]
        holder.send_multipart(altered + [mac])
        holder.send_multipart([bytes(f) for f in _payload("no mac").to_frames()])
        good = [bytes(f) for f in _payload("signed").to_frames()]
        good.append(FrameSigner(secret).mac(good))
        holder.send_multipart(good)
        assert [r.payload.transfer_id for r in _arrivals(receiver)] == ["signed"]
        holder.send_multipart(good)  # the same message again
        signed.send(_payload("after"), receiver.host, receiver.port)
        assert [r.payload.transfer_id for r in _arrivals(receiver)] == ["after"]
        assert receiver.num_refused == 4 and "replay" in receiver.last_refusal
    finally:
        stranger.close()
        holder.close()
        for sender in (signed, unsigned, wrong):
            sender.close()
        receiver.close()


def test_a_receiver_for_trusted_producers_refuses_others_at_the_handshake(monkeypatch) -> None:
    monkeypatch.setattr(zmq_connector, "SEND_TIMEOUT_MS", 300)
    untrusting = KVReceiver("127.0.0.1", 0, trusted_peers={"10.1.2.3"})
    trusting = KVReceiver("127.0.0.1", 0, trusted_peers={"127.0.0.1"})
    sender = KVSender()
    try:
        with pytest.raises(RuntimeError, match="took nothing"):
            sender.send(_payload(), untrusting.host, untrusting.port)
        assert not untrusting.take() and untrusting.num_refused == 0  # nothing of it ever reached the thread
        sender.send(_payload("trusted"), trusting.host, trusting.port)
        assert [r.payload.transfer_id for r in _arrivals(trusting)] == ["trusted"]
    finally:
        sender.close()
        untrusting.close()
        trusting.close()


def test_the_inbox_holds_a_bounded_number_of_payloads(monkeypatch) -> None:
    monkeypatch.setattr(zmq_connector, "MAX_INBOX_MESSAGES", 5)
    monkeypatch.setattr(zmq_connector, "SEND_TIMEOUT_MS", 300)
    receiver, sender = KVReceiver("127.0.0.1", 0), KVSender()
    try:
        for i in range(200):  # small payloads: the byte bound alone would take them all
            if sender.submit(_payload(f"p{i}"), receiver.host, receiver.port).exception(timeout=30) is not None:
                break
        time.sleep(0.3)
        assert receiver.num_waiting == 5
    finally:
        sender.close()
        receiver.close()


def test_a_dead_receiver_holds_up_only_its_own_lane_and_lanes_are_bounded(monkeypatch) -> None:
    monkeypatch.setattr(zmq_connector, "SEND_TIMEOUT_MS", 1500)
    monkeypatch.setattr(zmq_connector, "MAX_LANES", 2)
    sender, receiver = KVSender(), KVReceiver("127.0.0.1", 0)
    try:
        stuck = sender.submit(_payload("dead"), "127.0.0.1", free_port())
        started = time.monotonic()
        assert sender.send(_payload("live"), receiver.host, receiver.port) > 0
        assert time.monotonic() - started < 1.0 and not stuck.done()  # not behind the dead address's timeout
        with pytest.raises(RuntimeError, match="took nothing"):
            stuck.result(timeout=30)
        for _ in range(3):  # three more dead addresses: the lanes stay at the bound
            sender.submit(_payload(), "127.0.0.1", free_port())
        assert sender.num_lanes == 2
    finally:
        sender.close()
        receiver.close()
