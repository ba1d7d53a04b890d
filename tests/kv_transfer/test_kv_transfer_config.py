"""`--kv-transfer-config` (kv_transfer/config.py): vLLM's field names, roles, and clear refusals."""

from __future__ import annotations

import pytest

from llm_runtime.serving.kv_agent import TransferParams
from llm_runtime.kv_transfer.config import KVTransferConfig


def test_roles_and_defaults() -> None:
    producer = KVTransferConfig.from_json('{"kv_connector": "ZmqConnector", "kv_role": "kv_producer"}')
    assert producer.is_producer and not producer.is_consumer and producer.kv_port == 14579
    both = KVTransferConfig.from_json({"kv_role": "kv_both", "kv_port": 0})
    assert both.is_producer and both.is_consumer


@pytest.mark.parametrize("text, message", [
    ('{"kv_role": "kv_decoder"}', "kv_role must be one of"),
    ('{"kv_connector": "NixlConnector"}', "kv_connector must be one of ZmqConnector"),
    ('{"kv_port": 70000}', "kv_port must be a TCP port"),
    ('{"kv_prot": 5}', "unknown KV transfer config field 'kv_prot'"),
    ('[1]', "must be a JSON object"),
    ('{"kv_transfer_timeout_s": 0}', "kv_transfer_timeout_s must be"),
])
def test_bad_configs_are_refused(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KVTransferConfig.from_json(text)


@pytest.mark.parametrize("params, message", [
    ({"do_remote_decode": True}, "transfer_id must be a non-empty string"),
    ({"transfer_id": "t"}, "exactly one of do_remote_decode and do_remote_prefill"),
    ({"transfer_id": "t", "do_remote_decode": True, "do_remote_prefill": True}, "exactly one of"),
    ({"transfer_id": "t", "do_remote_decode": True}, "need remote_host and remote_port"),
])
def test_bad_transfer_params_are_refused(params: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TransferParams.parse(params)
    assert TransferParams.parse({"transfer_id": "t", "do_remote_prefill": True}).remote_prefill


def test_a_consumer_beyond_loopback_needs_a_secret() -> None:
    with pytest.raises(ValueError, match="beyond loopback, needs a kv_secret"):
        KVTransferConfig(kv_role="kv_consumer", kv_ip="0.0.0.0")
    with pytest.raises(ValueError, match="at least 16 characters"):
        KVTransferConfig(kv_role="kv_consumer", kv_ip="0.0.0.0", kv_secret="short")
    config = KVTransferConfig.from_json('{"kv_role": "kv_consumer", "kv_ip": "0.0.0.0"}', secret="x" * 16)
    assert config.kv_secret == "x" * 16 and "x" * 16 not in repr(config)
    assert KVTransferConfig(kv_role="kv_producer", kv_ip="0.0.0.0").kv_secret is None  # it binds nothing
    with pytest.raises(ValueError, match="host:port"):
        KVTransferConfig(kv_consumers=["10.0.0.1"])


def test_params_that_name_a_peer_are_honoured_only_when_trusted() -> None:
    """A client of a prefill server must not make it connect wherever the client says: without a secret, loopback
    addresses and the configured consumers only; with one, only what the router signed (and not once expired)."""
    from llm_runtime.kv_transfer.trust import sign_params

    ship = {"transfer_id": "t", "do_remote_decode": True, "remote_host": "10.0.0.9", "remote_port": 6379}
    with pytest.raises(ValueError, match="not a KV consumer this server trusts"):
        TransferParams.parse(ship)
    assert TransferParams.parse({**ship, "remote_host": "127.0.0.1"}).remote_port == 6379
    assert TransferParams.parse(ship, KVTransferConfig(kv_consumers=["10.0.0.9:6379"])).remote_host == "10.0.0.9"
    secret = "a-secret-the-router-shares"
    config = KVTransferConfig(kv_secret=secret)
    for unsigned in (ship, {**ship, "remote_host": "127.0.0.1"}, {"transfer_id": "t", "do_remote_prefill": True}):
        with pytest.raises(ValueError, match="must carry the router's signature"):
            TransferParams.parse(unsigned, config)
    signed = sign_params(secret, ship)
    parsed = TransferParams.parse(signed, config)
    assert parsed.signed and parsed.remote_host == "10.0.0.9"
    for forged in ({**signed, "remote_port": 22}, sign_params("another-secret-entirely", ship),
                   sign_params(secret, ship, ttl_s=-1)):
        with pytest.raises(ValueError, match="signature"):
            TransferParams.parse(forged, config)
    for bad, message in (({**ship, "colour": 1}, "unknown field 'colour'"),
                         ({**ship, "transfer_id": "../../x y"}, "transfer_id must be"),
                         ({**ship, "remote_host": "127.0.0.1", "remote_port": 70000}, "need remote_host"),
                         ({"transfer_id": "t", "do_remote_prefill": "yes"}, "must be true or false")):
        with pytest.raises(ValueError, match=message):
            TransferParams.parse(bad)
