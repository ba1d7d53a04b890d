"""How a step's inputs reach the other ranks (lesson 17): rank 0 schedules, every rank computes.

Rank 0's input buffers (input_batch.py) already hold a step's integers in one int64 buffer. Per step rank 0
broadcasts a fixed header (the kind of message, the segment sizes, and whether the step runs as the compiled
forward pass), then one payload: that buffer's used
prefix, each block table's length, the step's copy-on-write block pairs, and the rows whose logits the step
computes for prompt logprobs. Every other rank rebuilds the same ModelInput from it (`assemble_model_input`), so
all ranks run the same forward pass and the same sequence of `compute_logits` calls, in which their collectives
meet. Two broadcasts a step: the header's size is fixed, the payload's is the step's. The header goes over the
group's control group (gloo, on the CPU, without a practical timeout): the other ranks wait there between steps,
however long the engine stays idle.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import torch

from ..distributed.group import TensorParallelGroup
from .input_batch import StepLayout

STEP, STOP, CONFIGURE = 1, 2, 3
_HEADER = 9  # kind, num_tokens, num_sampling, num_seqs, width, num_copies, num_prompt_rows, samples, compiled


@dataclass(frozen=True)
class StepMessage:
    """One step as another rank receives it."""

    layout: StepLayout
    buffer: torch.Tensor  # (layout.bounds[-1],) int64 on the rank's device: the ModelInput's views come from it
    host: np.ndarray  # the same contents on the host
    block_tables_host: tuple[tuple[int, ...], ...]
    block_copies: list[tuple[int, int]]
    prompt_rows: list[tuple[int, int]]  # (first row, rows) of each item whose prompt logprobs this step computes
    samples: bool  # whether the step computes logits for its sampled rows
    compiled: bool = False  # whether rank 0 runs it as the compiled forward pass (every rank then does)


class StepChannel:
    """Rank 0's end sends; the other ranks' ends receive. Tensors travel on `device` (the CPU for gloo, the
    rank's GPU for NCCL)."""

    def __init__(self, tp: TensorParallelGroup, device: torch.device | str = "cpu") -> None:
        self.tp = tp
        self.device = torch.device(device)
        # Rank 0's first step may reach the workers while they still pack weights and build their pools after
        # the settings (workers.py): its header waits as long as that takes; later ones, the step's deadline.
        self._set_up = False

    def _broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.tp.broadcast_from_first(tensor)

    def _broadcast_header(self, header: torch.Tensor) -> torch.Tensor:
        return self.tp.broadcast_from_first(header, control=True)

    def send_step(self, layout: StepLayout, host: torch.Tensor, block_tables: tuple[tuple[int, ...], ...],
                  block_copies: list[tuple[int, int]], prompt_rows: list[tuple[int, int]], samples: bool,
                  compiled: bool = False) -> None:
        """Rank 0: the step whose buffer `host` holds (its first layout.bounds[-1] entries)."""
        used = layout.bounds[-1]
        extras = np.array([len(t) for t in block_tables] + [x for pair in block_copies for x in pair]
                          + [x for pair in prompt_rows for x in pair], dtype=np.int64)
        header = torch.tensor([STEP, layout.num_tokens, layout.num_sampling, layout.num_seqs, layout.width,
                               len(block_copies), len(prompt_rows), int(samples), int(compiled)], dtype=torch.int64)
        if self._set_up:
            self._broadcast_header(header)
        else:
            with self.tp.patient():
                self._broadcast_header(header)
            self._set_up = True
        payload = torch.cat([host[:used].cpu(), torch.from_numpy(extras)])
        self._broadcast(payload.to(self.device))

    def send_stop(self) -> None:
        """Rank 0: no more steps; the other ranks leave their loops."""
        self._broadcast_header(torch.tensor([STOP] + [0] * (_HEADER - 1), dtype=torch.int64))

    def send_json(self, value: object) -> None:
        """Rank 0: a small JSON value (the engine's settings, once) to every other rank. JSON, not pickle: what
        the ranks receive over their sockets is data, never code."""
        data = np.frombuffer(json.dumps(value).encode(), dtype=np.uint8)
        header = torch.tensor([CONFIGURE, len(data)] + [0] * (_HEADER - 2), dtype=torch.int64)
        self._broadcast_header(header)
        self._broadcast(torch.from_numpy(data.copy()).to(self.device))

    def receive(self) -> StepMessage | object | None:
        """Another rank: the next message (a StepMessage, a JSON value), or None after a stop."""
        header = self._broadcast_header(torch.empty(_HEADER, dtype=torch.int64)).tolist()
        kind = header[0]
        if kind == STOP:
            return None
        if kind == CONFIGURE:
            data = self._broadcast(torch.empty(header[1], dtype=torch.uint8, device=self.device))
            return json.loads(data.cpu().numpy().tobytes())
        if kind != STEP:
            raise RuntimeError(f"unknown step message kind {kind}")
        layout = StepLayout(*header[1:5])
        num_copies, num_prompt_rows, samples, compiled = header[5:9]
        used = layout.bounds[-1]
        size = used + layout.num_seqs + 2 * num_copies + 2 * num_prompt_rows
        payload = self._broadcast(torch.empty(size, dtype=torch.int64, device=self.device))
        host = payload.cpu().numpy()
        extras = host[used:].tolist()
        lengths, rest = extras[: layout.num_seqs], extras[layout.num_seqs :]
        tables = host[layout.bounds[6] : layout.bounds[7]].reshape(layout.num_seqs, layout.width)
        block_tables = tuple(tuple(tables[row, :n].tolist()) for row, n in enumerate(lengths))
        copies = [(rest[2 * i], rest[2 * i + 1]) for i in range(num_copies)]
        rest = rest[2 * num_copies :]
        prompt_rows = [(rest[2 * i], rest[2 * i + 1]) for i in range(num_prompt_rows)]
        return StepMessage(layout, payload[:used], host[:used], block_tables, copies, prompt_rows, bool(samples),
                           bool(compiled))
