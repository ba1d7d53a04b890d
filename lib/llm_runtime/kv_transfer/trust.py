"""Whom a server of a disaggregated pair trusts (lesson 18): the shared secret, the MAC over a KV message's frames,
signed `kv_transfer_params`, and the loopback rule.

KV blocks are the model's memory of a prompt: a receiver names what it takes in its prefix cache, so every later
request whose prompt starts with those tokens attends to them. Forged blocks would be wrong text for every user
of a popular system prompt, never an error. And a producer told where to ship by a request would connect wherever
a client says. So nothing from a socket is taken on its word:

- On one machine (every address loopback, the default) nothing needs configuring: a receiver bound to 127.0.0.1
  hears only this host's processes, and a producer ships only to loopback addresses.
- Beyond loopback, producers, consumers and the router share a secret (`kv_secret`, or the environment variable
  LLM_RUNTIME_KV_SECRET that the command line reads). The receiver's ZeroMQ socket then takes only CURVE
  connections from peers that know the secret (`curve_keys`: a peer without it never completes the handshake,
  so it cannot make the receiver buffer a byte), every KV message carries an HMAC-SHA256 over all its frames and
  the time it was sent (`FrameSigner`), and a receiver refuses a message without a valid, fresh, unseen one
  before it parses a byte of it. A receiver bound beyond loopback without a secret refuses to start.
- A request's `kv_transfer_params` name a peer (where to ship) or a transfer (whose blocks to claim). With a
  secret they are honoured only when the router signed them (`sign_params`: an HMAC over the fields and an
  expiry); a producer also ships to the consumers its own configuration names (`kv_consumers`). Without a
  secret, a producer ships to loopback addresses only, and a consumer lets a request claim blocks only when they
  hold its own prompt's first tokens (agent.py).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import struct
import time
from collections.abc import Sequence
from typing import Any

SECRET_ENV = "LLM_RUNTIME_KV_SECRET"  # where the command line looks for the secret when the config gives none
MIN_SECRET_CHARS = 16
MAC_BYTES = 32  # HMAC-SHA256
PARAMS_TTL_S = 60.0  # how long a router's signature on kv_transfer_params stays good
MAX_CLOCK_SKEW_S = 60.0  # how far ahead of the receiver's clock a sender's may run


def is_loopback(host: str) -> bool:
    """Whether `host` is this machine's loopback: "localhost" or a loopback address (a name that could resolve
    elsewhere is not)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_unspecified(host: str) -> bool:
    """Whether `host` means "every interface" (0.0.0.0, ::): an address to bind, not one to connect to."""
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def check_secret(secret: object) -> None:
    """ValueError unless `secret` is None or a string long enough to be one."""
    if secret is not None and (not isinstance(secret, str) or len(secret) < MIN_SECRET_CHARS):
        raise ValueError(f"kv_secret must be a string of at least {MIN_SECRET_CHARS} characters (or left out)")


def curve_keys(secret: str, role: str) -> tuple[bytes, bytes]:
    """(public, secret) CURVE keys (Z85) for `role` ("receiver" or "sender"), derived from the shared secret: a
    ZeroMQ socket that holds the receiver's public key can only be one whose owner knows the secret, so a peer
    without it never completes the handshake, and sends nothing at all (zmq_connector.py)."""
    import zmq
    from zmq.utils import z85

    private = z85.encode(hashlib.sha256(f"llm_runtime kv {role}\0{secret}".encode()).digest())
    return zmq.curve_public(private), private


class FrameSigner:
    """The MAC of a KV message: HMAC-SHA256 over every frame, each prefixed by its length, under a shared key."""

    def __init__(self, secret: str) -> None:
        check_secret(secret)
        self._key = hashlib.sha256(b"llm_runtime kv frames\0" + secret.encode()).digest()

    def mac(self, frames: Sequence[Any]) -> bytes:
        digest = hmac.new(self._key, digestmod=hashlib.sha256)
        for frame in frames:
            view = memoryview(frame).cast("B")
            digest.update(struct.pack("<Q", view.nbytes))
            digest.update(view)
        return digest.digest()

    def verify(self, frames: Sequence[Any], mac: Any) -> bool:
        """Whether `mac` is the MAC of `frames` (compared in constant time)."""
        return hmac.compare_digest(self.mac(frames), bytes(mac))


def fresh(sent_at: object, max_age_s: float, now: float | None = None) -> bool:
    """Whether a message sent at `sent_at` (the sender's time.time()) is recent enough to take."""
    now = time.time() if now is None else now
    return (isinstance(sent_at, (int, float)) and not isinstance(sent_at, bool)
            and now - max_age_s <= sent_at <= now + MAX_CLOCK_SKEW_S)


def _params_mac(secret: str, params: dict[str, Any]) -> str:
    key = hashlib.sha256(b"llm_runtime kv params\0" + secret.encode()).digest()
    fields = {name: value for name, value in params.items() if name != "signature"}
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hmac.new(key, text.encode(), hashlib.sha256).hexdigest()


def sign_params(secret: str, params: dict[str, Any], ttl_s: float = PARAMS_TTL_S) -> dict[str, Any]:
    """`params` with an expiry and the router's signature over every field."""
    signed = {**params, "expires": round(time.time() + ttl_s, 3)}
    signed["signature"] = _params_mac(secret, signed)
    return signed


def signed_by(secret: str | None, params: dict[str, Any]) -> bool:
    """Whether `params` carry a valid, unexpired signature under `secret` (False without a secret)."""
    signature, expires, now = params.get("signature"), params.get("expires"), time.time()
    if secret is None or not isinstance(signature, str):
        return False
    if isinstance(expires, bool) or not isinstance(expires, (int, float)):
        return False
    if not now <= expires <= now + PARAMS_TTL_S + MAX_CLOCK_SKEW_S:
        return False
    return hmac.compare_digest(_params_mac(secret, params), signature)
