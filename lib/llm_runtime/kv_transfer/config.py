"""`--kv-transfer-config`: a server's part in disaggregated prefill and decode (lesson 18), with vLLM's field names.

    serve --kv-transfer-config '{"kv_connector": "ZmqConnector", "kv_role": "kv_producer"}'
    serve --kv-transfer-config '{"kv_connector": "ZmqConnector", "kv_role": "kv_consumer", "kv_port": 14580}'

`kv_role`: "kv_producer" prefills prompts and ships their KV blocks, "kv_consumer" receives blocks at
`kv_ip`:`kv_port` and decodes, "kv_both" does either, as each request asks (its `kv_transfer_params`).
`kv_connector` names the transport; the one this package has is "ZmqConnector" (zmq_connector.py: ZeroMQ
messages over TCP, as vLLM's P2P connectors use it for their control messages). Unknown fields are refused,
so a misspelt one is not silently ignored.

Whom a server trusts (trust.py): on loopback, the defaults. Beyond it, `kv_secret` (at least 16 characters; the
command line reads LLM_RUNTIME_KV_SECRET when the JSON gives none, which keeps it out of `ps`), shared by the
producers, the consumers and the router: messages and routed params are signed with it. A consumer bound beyond
loopback without one refuses to start. `kv_trusted_producers` narrows a consumer to the producers at these
addresses; `kv_consumers` ("host:port") are where a producer ships without the router's signature.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from .trust import SECRET_ENV, check_secret, is_loopback

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_CONNECTORS = ("ZmqConnector",)


@dataclass(frozen=True)
class KVTransferConfig:
    """Which side of a KV transfer this server takes, and where it receives blocks."""

    kv_connector: str = "ZmqConnector"
    kv_role: str = "kv_both"
    kv_ip: str = "127.0.0.1"  # where a consumer binds its receiving socket (and what it tells a router)
    kv_port: int = 14579  # vLLM's default; 0: any free port (GET /v1/kv_transfer says which)
    # How long a decode request waits for its prompt's blocks before it computes the prompt itself, and how long
    # received blocks no request has claimed are held.
    kv_transfer_timeout_s: float = 30.0
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    kv_secret: str | None = field(default=None, repr=False)  # trust.py; never printed
    kv_trusted_producers: tuple[str, ...] | None = None  # IP addresses a consumer takes KV from (None: any)
    kv_consumers: tuple[str, ...] = ()  # "host:port" a producer ships to on an unsigned request

    def __post_init__(self) -> None:
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(f"kv_connector must be one of {', '.join(KV_CONNECTORS)}, got {self.kv_connector!r}")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {', '.join(KV_ROLES)}, got {self.kv_role!r}")
        if isinstance(self.kv_port, bool) or not isinstance(self.kv_port, int) or not 0 <= self.kv_port < 65536:
            raise ValueError(f"kv_port must be a TCP port (0-65535; 0: any free one), got {self.kv_port!r}")
        timeout = self.kv_transfer_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
            raise ValueError(f"kv_transfer_timeout_s must be a number of seconds > 0, got {timeout!r}")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError("kv_connector_extra_config must be an object")
        check_secret(self.kv_secret)
        for name in ("kv_trusted_producers", "kv_consumers"):
            value = getattr(self, name)
            if value is None and name == "kv_trusted_producers":
                continue
            if not isinstance(value, (list, tuple)) or not all(isinstance(item, str) and item for item in value):
                raise ValueError(f"{name} must be a list of addresses")
            object.__setattr__(self, name, tuple(value))
        if any(":" not in address or not address.rsplit(":", 1)[1].isdigit() for address in self.kv_consumers):
            raise ValueError(f"kv_consumers are \"host:port\" addresses, got {list(self.kv_consumers)}")
        if not isinstance(self.kv_ip, str) or not self.kv_ip:
            raise ValueError(f"kv_ip must be an address, got {self.kv_ip!r}")
        if self.is_consumer and not is_loopback(self.kv_ip) and self.kv_secret is None:
            raise ValueError(f"a KV consumer receiving on {self.kv_ip}, beyond loopback, needs a kv_secret shared "
                             f"with its producers and router (or {SECRET_ENV} in the environment): anyone who "
                             f"reaches the port could otherwise write into its prefix cache")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def from_json(cls, text: str | dict[str, Any], secret: str | None = None) -> "KVTransferConfig":
        """The config a JSON object (or a dict) gives; ValueError naming an unknown field or a bad value. `secret`:
        the kv_secret to use when the JSON gives none (the command line passes LLM_RUNTIME_KV_SECRET's)."""
        values = json.loads(text) if isinstance(text, str) else text
        if not isinstance(values, dict):
            raise ValueError("the KV transfer config must be a JSON object")
        values = dict(values)
        if values.get("kv_secret") is None and secret:
            values["kv_secret"] = secret
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown KV transfer config field {unknown[0]!r}; the fields are {', '.join(sorted(known))}")
        return cls(**values)
