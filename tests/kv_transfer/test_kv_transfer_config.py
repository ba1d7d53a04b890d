"""`--kv-transfer-config` (kv_transfer/config.py): vLLM's field names, roles, and clear refusals."""

from __future__ import annotations

import pytest

from llm_runtime.kv_transfer.agent import TransferParams
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
