"""The shapes of the engine's live events (`/v1/engine/events`, engine_events.py; the dashboard reads them): an
`EngineHello` first, then `EngineState`s, each named by its `type`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Event(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EngineHello(_Event):
    """The first event a subscriber gets: what stays fixed for the engine's life."""

    type: Literal["hello"]
    model: str
    time: float  # seconds on the feed's clock (every event's times are)
    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    device: str
    kv_cache_dtype: str
    tensor_parallel_size: int
    speculative: dict[str, Any] | None
    block_states: dict[str, str]  # state name -> its character in EngineKV.states
    interval_ms: float  # state events come at most this often (and when the engine goes idle)


class EngineStep(_Event):
    step: int
    start: float
    duration_ms: float
    # Per sequence in the step: [request id, completion index, prefill tokens, decode tokens (drafts included),
    # drafts verified, drafts kept].
    items: list[tuple[str, int, int, int, int, int]]
    preempted: list[tuple[str, int]]  # [request id, completion index] of the sequences this step preempted


class EngineSequence(_Event):
    id: str
    index: int
    prompt_tokens: int
    output_tokens: int
    computed_tokens: int
    arrival: float
    first_token: float | None
    blocks: list[int] | None = None  # running: its block table, in order
    preempted: bool | None = None  # waiting: whether it ran before (and lost its blocks)


class EngineFinished(_Event):
    id: str
    # "stop", "length", "abort", "error" (several completions: their reasons joined by commas; "unknown" where the
    # feed did not see a completion end, one that finished before this subscriber came)
    reason: str
    arrival: float | None = None  # None for an abort
    output_tokens: int | None  # every completion's
    ttft_ms: float | None
    itl_ms: float | None  # mean time between one completion's tokens


class EngineKV(_Event):
    num_blocks: int
    block_size: int
    states: str  # one character per block, EngineHello.block_states


class EngineState(_Event):
    """What the engine did since the last state event, and what it holds now."""

    type: Literal["state"]
    event: int
    time: float
    steps: list[EngineStep]
    running: list[EngineSequence]
    waiting: list[EngineSequence]
    finished: list[EngineFinished]
    kv: EngineKV | None  # None: not built this time (a large pool's states are sent less often; engine_events.py)
    counters: dict[str, int]


class EngineEvent(BaseModel):
    """One server-sent event of `GET /v1/engine/events`: its `data` is what `event` holds here, a hello or a state
    (validate one with `EngineEvent.model_validate({"event": data})`)."""

    event: EngineHello | EngineState = Field(discriminator="type")
