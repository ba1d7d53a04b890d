"""A step's model inputs, built once into buffers that live as long as the runner: `ModelInput`.

Every step the model needs the same kinds of integers: the new tokens' ids and positions, the flat
pool slot each one's key and value go to, where each sequence's rows start, how many keys each one
sees, its block table, and which rows' logits are sampled. Built naively that is a dozen small
tensors per step, each from a Python list, each its own host-to-device copy from pageable memory.

`InputBuffers` writes all of them into one int64 host buffer (pinned memory on CUDA, so the copy can
run asynchronously) with NumPy, vectorized per sequence rather than per token, and moves the step's
used prefix to the device in one copy. The device tensors the model reads are views of one device
buffer; the int32 ones (offsets, lengths, block tables, as the kernels take them) are cast there. On
the CPU there is no copy at all: the views are the host buffer.

The views are overwritten by the next step: nothing may keep them across steps. On CUDA the copy is
asynchronous: it reads the pinned buffer whenever the GPU gets to it, possibly steps later, since a step
that samples nothing (a chunk of a long prompt) returns without waiting for the device. So there are two
pinned buffers, used in turn, and an event recorded after each one's copy; a buffer is rewritten only
after its event, the copy of two steps ago, has happened (`_HostBuffer.reuse`). Nothing else waits: the
device buffer is rewritten by the next copy on the same stream, after every kernel that reads it. The
buffers grow when a step needs more room, so the retry of a failed step (one request at a time) and any
batch shape work without configuration.

`AttentionMetadata.build` remains the plain reference this is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from ..attention.metadata import AttentionMetadata

if TYPE_CHECKING:
    from ..core.scheduler import ScheduledBatch


@dataclass(frozen=True)
class ModelInput:
    """What one step's forward pass and sampler read, built from a `ScheduledBatch`."""

    input_ids: torch.Tensor  # (1, N) int64: every scheduled token, sequence after sequence
    positions: torch.Tensor  # (1, N) int64: each token's position in its sequence
    metadata: AttentionMetadata  # offsets, lengths, block tables and slots, for every attention layer
    # (R,) int64: the flat rows whose logits are sampled: each sampling sequence's last token, and before it
    # the rows of the drafts it verifies (1 + k rows for k drafts, lesson 14)
    logits_indices: torch.Tensor
    sampling_items: tuple[int, ...]  # which of the batch's items sample, in row order
    query_start_host: tuple[int, ...]  # (B + 1,) where each item's rows start, on the host
    layout: "StepLayout | None" = None  # where each tensor lies in the buffer they are views of

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])


class _Event(Protocol):
    """What `_HostBuffer` needs of a torch.cuda.Event: to wait until the work before it ran."""

    def synchronize(self) -> None: ...


class _HostBuffer:
    """One pinned (or, on the CPU, plain) int64 host buffer and the event after the last copy that read it."""

    def __init__(self, capacity: int, pinned: bool) -> None:
        # Inference tensors, as everything a step computes is (the runner runs under inference mode): a compiled
        # forward pass (compiled_forward.py) guards on the kind of tensor it was traced with.
        with torch.inference_mode():
            self.tensor = torch.zeros(capacity, dtype=torch.int64, pin_memory=pinned)
        self.numpy = self.tensor.numpy()  # the same memory, for NumPy's vectorized writes
        self.copied: _Event | None = None  # recorded after the asynchronous copy that reads this buffer

    def reuse(self) -> None:
        """Wait until the copy that last read this buffer happened, so that it may be rewritten."""
        if self.copied is not None:
            self.copied.synchronize()
            self.copied = None


class InputBuffers:
    """Persistent host (and device) buffers that `prepare` fills for each step."""

    def __init__(self, device: torch.device | str, block_size: int, capacity: int = 1 << 14) -> None:
        self.device = torch.device(device)
        self.block_size = block_size
        # Decided here, once: on CUDA the host buffers are pinned and each copy is followed by an event; elsewhere
        # (the CPU, or `meta` in tests) a copy has read its source before it returns.
        self.pinned = self.device.type == "cuda"
        self.separate = self.device.type != "cpu"  # the device has its own buffer, else the views are the host's
        self.capacity = 0
        self.num_allocations = 0  # how often the buffers were (re)allocated: once, unless a step outgrew them
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        # Two host buffers where a copy to the device reads them asynchronously (module docstring), else one.
        # Buffers replaced here are freed safely: PyTorch's pinned allocator keeps a block until its copies ran.
        self._hosts = [_HostBuffer(capacity, pinned=self.pinned) for _ in range(2 if self.separate else 1)]
        self._turn = 0
        with torch.inference_mode():
            self.on_device = self._hosts[0].tensor if not self.separate else torch.zeros(
                capacity, dtype=torch.int64, device=self.device)
        self.capacity = capacity
        self.num_allocations += 1

    @property
    def host(self) -> torch.Tensor:
        """The host buffer the last step was written into."""
        return self._hosts[self._turn].tensor

    def _record_copy(self) -> _Event | None:
        """An event on the current stream, after the copy just enqueued (on CUDA; elsewhere a copy from pageable
        memory has read it before it returns)."""
        if not self.pinned:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def prepare(self, batch: ScheduledBatch) -> ModelInput:
        """Write the batch's inputs into the buffers and return device views of them."""
        items = batch.items
        num_seqs = len(items)
        starts = np.fromiter((item.start for item in items), dtype=np.int64, count=num_seqs)
        counts = np.fromiter((item.num_new_tokens for item in items), dtype=np.int64, count=num_seqs)
        seq_lens = starts + counts
        offsets = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        num_tokens = int(offsets[-1])
        width = max((len(item.block_table) for item in items), default=0)
        for item, length in zip(items, seq_lens.tolist()):
            if len(item.block_table) * self.block_size < length:
                raise ValueError(f"a block table of {len(item.block_table)} blocks cannot hold {length} tokens")
        sampling = tuple(i for i, item in enumerate(items) if item.samples)
        # A sequence verifying k drafts samples from the logits of its last k + 1 rows (lesson 14).
        rows_per_item = np.fromiter((1 + len(items[i].draft_token_ids) for i in sampling), dtype=np.int64,
                                    count=len(sampling))
        num_sampling = int(rows_per_item.sum())

        # One int64 buffer, in the segments StepLayout names.
        layout = StepLayout(num_tokens, num_sampling, num_seqs, width)
        bounds = layout.bounds
        if bounds[-1] > self.capacity:
            self._allocate(max(bounds[-1], 2 * self.capacity))
        self._turn = (self._turn + 1) % len(self._hosts)
        buffer = self._hosts[self._turn]
        buffer.reuse()  # its copy of two steps ago may still be pending on the GPU
        host = buffer.numpy
        ids, positions, slots, logits_rows, query_start, lengths, tables = (
            host[a:b] for a, b in zip(bounds[:-1], bounds[1:]))

        # Token ids come from each sequence's list; everything else is arithmetic on whole arrays.
        ids[:] = np.fromiter((t for item in items for t in item.token_ids()), dtype=np.int64, count=num_tokens)
        seq_of_token = np.repeat(np.arange(num_seqs), counts)  # (N,)
        positions[:] = np.arange(num_tokens) - offsets[:-1][seq_of_token] + starts[seq_of_token]
        table = tables.reshape(num_seqs, width)  # (B, width), padded with block 0
        table[:] = 0
        for row, item in enumerate(items):
            table[row, : len(item.block_table)] = item.block_table
        if num_tokens:
            slots[:] = table[seq_of_token, positions // self.block_size] * self.block_size + positions % self.block_size
        logits_rows[:] = _last_rows(offsets[1:][list(sampling)], rows_per_item)
        query_start[:] = offsets
        lengths[:] = seq_lens

        device = self.on_device
        if device is not buffer.tensor:  # one copy to the device for the whole step
            device[: bounds[-1]].copy_(buffer.tensor[: bounds[-1]], non_blocking=True)
            buffer.copied = self._record_copy()
        return assemble_model_input(device, host, layout, self.block_size,
                                    tuple(tuple(item.block_table) for item in items), sampling)


@dataclass(frozen=True)
class StepLayout:
    """The sizes of a step's segments in the int64 buffer, in order: ids, positions, slots (N each), logits rows
    (R), offsets (B + 1), lengths (B), block tables (B x width). With them another rank reads the same buffer
    (tensor parallelism, step_channel.py)."""

    num_tokens: int
    num_sampling: int
    num_seqs: int
    width: int

    @property
    def bounds(self) -> list[int]:
        n, b = self.num_tokens, self.num_seqs
        return np.cumsum([0, n, n, n, self.num_sampling, b + 1, b, b * self.width]).tolist()


def assemble_model_input(device_buffer: torch.Tensor, host_buffer: np.ndarray, layout: StepLayout, block_size: int,
                         block_tables_host: tuple[tuple[int, ...], ...], sampling: tuple[int, ...]) -> ModelInput:
    """The ModelInput whose tensors are views of a buffer written as `layout` says (on the device), with the host
    shapes read from the same contents on the host (`host_buffer`: nothing waits for the device)."""
    bounds = layout.bounds
    views = [device_buffer[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    offsets = host_buffer[bounds[4] : bounds[5]].tolist()
    seq_lens = host_buffer[bounds[5] : bounds[6]].tolist()
    metadata = AttentionMetadata(
        block_size=block_size,
        query_start_loc=views[4].to(torch.int32),
        seq_lens=views[5].to(torch.int32),
        block_tables=views[6].view(layout.num_seqs, layout.width).to(torch.int32),
        slot_mapping=views[2],
        query_lens_host=tuple(b - a for a, b in zip(offsets[:-1], offsets[1:])),
        seq_lens_host=tuple(seq_lens),
        block_tables_host=block_tables_host,
    )
    return ModelInput(input_ids=views[0][None], positions=views[1][None], metadata=metadata,
                      logits_indices=views[3], sampling_items=sampling, query_start_host=tuple(offsets), layout=layout)


def _last_rows(ends: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """For items ending before rows ends (S,), their last counts (S,) rows each, in order: (sum of counts,)."""
    firsts = np.repeat(ends - counts, counts)  # each row's item's first sampled row
    within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)  # 0 .. count - 1
    return firsts + within
