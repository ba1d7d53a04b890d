"""How the router chooses a backend (lesson 18): the backends of one kind (`Pool`) and its policies, round-robin,
least loaded and cache-aware (router.py's docstring says what each does)."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
from collections import OrderedDict
from collections.abc import Container, Sequence
from dataclasses import dataclass, field
from typing import Any

POLICIES = ("round_robin", "least_loaded", "cache_aware")
CHUNK = 64  # characters per hashed chunk of a prompt (cache_aware)
MIN_MATCH = 0.5  # the share of a prompt a replica must have seen for cache_aware to prefer it over the least loaded
MAX_REMEMBERED = 50_000  # chunk hashes remembered per replica, least recently used forgotten first


@dataclass(eq=False)
class Backend:
    """One server behind the router: its URL, whether it answers, and what this router has in flight there."""

    url: str
    role: str  # "prefill", "decode" or "replica"
    healthy: bool = True
    missed: int = 0  # probes missed in a row
    in_flight: int = 0
    kv_address: tuple[str, int] | None = None  # a decode server's: where it receives KV blocks
    tasks: set[asyncio.Task] = field(default_factory=set)  # requests in flight (cancelled if it goes down)
    remembered: OrderedDict[bytes, None] = field(default_factory=OrderedDict)  # cache_aware's chunk hashes


def prompt_text(body: dict[str, Any]) -> str:
    """What a request's prompt is, as text the router can compare: the completion prompt, or the chat messages."""
    if "messages" in body:
        return json.dumps(body["messages"], sort_keys=True, ensure_ascii=False)
    return json.dumps(body.get("prompt"), ensure_ascii=False)


def chunk_hashes(text: str) -> list[bytes]:
    """Chained hashes of `text`'s whole CHUNK-character chunks: equal lists mean equal prefixes."""
    hashes, parent = [], b""
    for start in range(0, len(text) - CHUNK + 1, CHUNK):
        parent = hashlib.blake2b(parent + text[start : start + CHUNK].encode(), digest_size=16).digest()
        hashes.append(parent)
    return hashes


def cache_aware_choice(hashes: Sequence[bytes], remembered: Sequence[Container[bytes]], in_flight: Sequence[int],
                       min_match: float = MIN_MATCH) -> int:
    """Which replica gets a prompt of these chained chunk hashes: the one that was sent the longest run of them
    (its first k hashes, for the largest k), when that run is at least one chunk and at least `min_match` of the
    prompt's chunks; otherwise the least loaded. Ties go to the first replica."""
    least = min(range(len(in_flight)), key=in_flight.__getitem__)
    best, best_match = least, 0
    for index, seen in enumerate(remembered):
        match = next((i for i, h in enumerate(hashes) if h not in seen), len(hashes))
        if match > best_match:
            best, best_match = index, match
    return best if best_match > 0 and best_match >= min_match * len(hashes) else least


class Pool:
    """The backends of one kind, and how the next one is chosen."""

    def __init__(self, backends: list[Backend], policy: str) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.backends, self.policy = backends, policy
        self._turn = itertools.count()

    def healthy(self) -> list[Backend]:
        return [b for b in self.backends if b.healthy]

    def choose(self, text: str, exclude: Container[Backend] = ()) -> Backend | None:
        """The backend for a prompt, not one of `exclude` (None: no other is healthy); cache_aware remembers where
        the prompt went."""
        candidates = [b for b in self.healthy() if b not in exclude]
        if not candidates:
            return None
        if self.policy == "round_robin":
            return candidates[next(self._turn) % len(candidates)]
        if self.policy == "least_loaded":
            return min(candidates, key=lambda b: b.in_flight)
        hashes = chunk_hashes(text)
        chosen = candidates[cache_aware_choice(hashes, [b.remembered for b in candidates],
                                               [b.in_flight for b in candidates])]
        for h in reversed(hashes):  # a prompt's first chunk most recent: forgotten last (a match starts with it)
            chosen.remembered[h] = None
            chosen.remembered.move_to_end(h)
        while len(chosen.remembered) > MAX_REMEMBERED:
            chosen.remembered.popitem(last=False)
        return chosen


class BackendFailed(Exception):
    """A backend could not be reached or answered with a server error."""

    def __init__(self, backend: Backend, message: str) -> None:
        super().__init__(message)
        self.backend = backend
