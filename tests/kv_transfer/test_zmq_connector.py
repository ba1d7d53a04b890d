"""The ZeroMQ transport (kv_transfer/zmq_connector.py): a payload crosses loopback whole; a sender hands its
payloads to a thread of its own; a receiver that is gone fails one send after the timeout and the next ones at
once, while a live receiver still gets its payload; payloads past the byte budget are refused at once; the
transfer histograms keep counts, not values."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from llm_runtime.kv_transfer import zmq_connector
from llm_runtime.kv_transfer.agent import Durations
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
        assert len(arrived) == 1 and arrived[0].nbytes == sent and arrived[0].error is None
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
    monkeypatch.setattr(sender, "_send", lambda payload, host, port: release.wait(30) and size)
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
