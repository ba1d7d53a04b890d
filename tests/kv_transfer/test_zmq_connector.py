"""The ZeroMQ transport (kv_transfer/zmq_connector.py): a payload crosses loopback whole; a sender hands its
payloads to a thread of its own, so a receiver that is gone fails its sends after the timeout without holding up
the caller, and a full queue is refused at once; the transfer histograms keep counts, not values."""

from __future__ import annotations

import time

import pytest
import torch

from llm_runtime.kv_transfer import zmq_connector
from llm_runtime.kv_transfer.agent import Durations
from llm_runtime.kv_transfer.payload import KVLayout, KVPayload
from llm_runtime.kv_transfer.zmq_connector import KVReceiver, KVSender
from llm_runtime.lessons.disaggregation import free_port


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


def test_a_dead_receiver_fails_sends_without_holding_up_the_caller(monkeypatch) -> None:
    monkeypatch.setattr(zmq_connector, "SEND_TIMEOUT_MS", 300)
    monkeypatch.setattr(zmq_connector, "MAX_PENDING", 2)
    sender = KVSender()
    port = free_port()  # nobody listens there
    try:
        started = time.monotonic()
        first, second, third = (sender.submit(_payload(str(i)), "127.0.0.1", port) for i in range(3))
        assert time.monotonic() - started < 0.25  # handed over, not sent
        with pytest.raises(RuntimeError, match="already wait"):
            third.result(timeout=1)  # the queue holds 2
        for future in (first, second):
            with pytest.raises(RuntimeError, match="took nothing"):
                future.result(timeout=10)
        later = sender.submit(_payload("later"), "127.0.0.1", port)  # the queue emptied: taken again
        with pytest.raises(RuntimeError, match="took nothing"):
            later.result(timeout=10)
    finally:
        sender.close()


def test_durations_keep_bucket_counts() -> None:
    durations = Durations()
    for seconds in (0.0004, 0.003, 0.003, 2.0):
        durations.observe(seconds)
    assert durations.count == 4 and durations.total == pytest.approx(2.0064)
    counts = dict(zip(durations.bounds, durations.counts))
    assert counts[0.0005] == 1 and counts[0.0025] == 1 and counts[0.005] == 3 and counts[1.0] == 3
