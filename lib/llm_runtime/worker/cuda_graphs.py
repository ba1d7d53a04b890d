"""CUDA graphs for decode steps, one per batch-size bucket: a whole forward pass in one launch.

A decode step of a small model on a GPU is a few hundred small kernels (per layer: norms, four or
five matrix multiplies, rotary, the KV store, attention, the MLP's pointwise parts). Each launch costs
the CPU a few microseconds of Python and driver work, and at batch 1 most kernels take less than
that on the GPU, so the GPU waits on the CPU. A CUDA graph records the kernels of one forward pass
once (`torch.cuda.graph`) and replays them all with one call: the CPU's cost per step becomes one
launch, whatever the number of kernels.

What capture forbids follows from "the kernels and their arguments are recorded, not the Python":
- fixed shapes: a graph replays the shapes it saw, so one graph is captured per batch size, for
  the buckets 1, 2, 4, 8, then every 16 up to `max_num_seqs`. A step of n decodes replays the
  smallest bucket b >= n; its rows n..b-1 are padding (slot -1: they write no key or value; one key:
  they read one valid slot), and their logits are ignored.
- fixed addresses: kernels read their inputs from the tensors they saw at capture. Each step copies
  its ids, positions, slots, lengths and block tables into static buffers that live as long as the
  graphs; the graphs write logits into one static output of the largest bucket's size, bucket b
  into its first b rows (what `run` returns is a view of it: valid until the next replay).
- no host decisions: Python branches on data ran once, at capture. The attention backend's plan is
  made for the longest sequence the engine allows (`max_model_len`) and kept; its kernels read the
  real lengths on the device (`AttentionBackend.supports_cuda_graphs`).
- no host synchronization (`.item()`, `.tolist()`, a CPU tensor made from device data) inside.
Prefill and mixed steps change shape every step: they run eagerly, as in vLLM's default.

The buckets are captured largest first into one memory pool, so the smaller graphs reuse the
largest one's intermediate memory. A tensor made during a capture keeps its memory in the pool for
as long as it lives (PyTorch's CUDA notes, "Graph memory management"), so nothing made there is
kept: a graph's logits are copied into the shared static output, made outside any capture, and
the pool holds one bucket's worth of intermediates, the largest's, not the sum of every bucket's.
PyTorch calls a shared pool safe when graphs replay in capture order and never concurrently; ours
replay in any order but never concurrently, which is safe for the same reason the rule exists: no
graph reads pool memory that another graph wrote (every value that outlives a replay lives in the
static buffers, outside the pool). The pool and the static buffers are the graphs' alone: the KV
budget keeps room for both before sizing the KV pool (`graph_memory_bytes`). Warm-up and capture run
on a side stream of the model's device, as `torch.cuda.graph` wants (the default stream cannot be
captured); replays run on the current stream. `replay="eager"` runs the same captured function
(static buffers, padding, the kept plan) without a graph: on the CPU, with the Triton backend under
its interpreter, it tests everything but the graph itself.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass
from typing import Callable, Literal

import torch

from ..attention.backend import AttentionBackend, PagedAttentionStep
from ..attention.kv_cache import PagedKVCache
from ..attention.metadata import AttentionMetadata
from ..config import ModelConfig
from ..model import CausalLM
from .input_batch import ModelInput

logger = logging.getLogger(__name__)

Replay = Literal["graph", "eager"]


def graph_batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The buckets: 1, 2, 4, 8, then every 16 up to `max_num_seqs` (which is always one)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [size for size in (1, 2, 4, 8) if size < max_num_seqs]
    sizes += range(16, max_num_seqs, 16)
    return (*sizes, max_num_seqs)


def graphs_unavailable_reason(device: torch.device, backend: AttentionBackend) -> str | None:
    """None when decode steps can be captured here; otherwise why not."""
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device, not {device.type}"
    if not backend.supports_cuda_graphs:
        return f"the {backend.name} attention backend cannot be captured in a CUDA graph"
    return None


@dataclass(frozen=True)
class GraphMemory:
    """What captured decode graphs hold, in bytes: the largest bucket's share of the private pool, and the
    static buffers made outside it."""

    activations: int  # the largest bucket's forward intermediates at their peak (in the pool)
    pool_logits: int  # its logits as computed, before the copy into the static output (in the pool)
    workspace: int  # the attention backend's decode scratch (split-KV partials; in the pool)
    static_logits: int  # the shared static output, (largest bucket, vocab)
    static_inputs: int  # ids, positions, slots, lengths, block tables

    @property
    def total(self) -> int:
        return self.activations + self.pool_logits + self.workspace + self.static_logits + self.static_inputs


def graph_memory(model_config: ModelConfig, backend: AttentionBackend, *, max_num_seqs: int, max_model_len: int,
                 dtype: torch.dtype, block_size: int = 16) -> GraphMemory:
    """An estimate of what `DecodeGraphs` keeps once captured (see `GraphMemory`). Activations: per row a few
    hidden-sized buffers, q/k/v, the MLP's gate, up and product; logits in `dtype` (the head's output, as
    `compute_logits` returns it), once in the pool and once in the static output. `block_size` sizes the
    static block tables (the default, 16, is an upper bound for any larger block)."""
    c = model_config
    per_row = 6 * c.hidden_size + 3 * c.intermediate_size + (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    itemsize = torch.empty((), dtype=dtype).element_size()
    logits = max_num_seqs * c.vocab_size * itemsize
    max_blocks = -(-max_model_len // block_size)
    # int64 ids, positions and slots; int32 lengths, query starts and block tables (as DecodeGraphs makes them)
    inputs = 3 * 8 * max_num_seqs + 4 * (2 * max_num_seqs + 1) + 4 * max_num_seqs * max_blocks
    return GraphMemory(
        activations=max_num_seqs * per_row * itemsize,
        pool_logits=logits,
        workspace=backend.decode_workspace_bytes(max_num_seqs, max_model_len, c.num_heads, c.head_dim),
        static_logits=logits,
        static_inputs=inputs,
    )


def graph_memory_bytes(model_config: ModelConfig, backend: AttentionBackend, *, max_num_seqs: int,
                       max_model_len: int, dtype: torch.dtype, block_size: int = 16) -> int:
    """The bytes the KV budget keeps for captured decode graphs: their private pool and static buffers."""
    return graph_memory(model_config, backend, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                        dtype=dtype, block_size=block_size).total


class DecodeGraphs:
    """A captured decode step per bucket, with the static buffers every bucket reads and writes."""

    def __init__(self, model: CausalLM, kv_cache: PagedKVCache, backend: AttentionBackend, *,
                 max_num_seqs: int, max_model_len: int, replay: Replay = "graph") -> None:
        if replay == "graph":
            reason = graphs_unavailable_reason(model.device, backend)
            if reason is not None:
                raise ValueError(reason)
        elif replay != "eager":
            raise ValueError(f"replay must be 'graph' or 'eager', got {replay!r}")
        self.model, self.kv_cache, self.backend = model, kv_cache, backend
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        self.replay_mode = replay
        self.num_replays = 0  # decode steps that ran from a graph
        device, size = model.device, self.sizes[-1]
        self.block_size = kv_cache.block_size
        self.max_blocks = -(-max_model_len // self.block_size)  # a block table's widest row
        # The static inputs, as the largest bucket needs them; bucket b reads the first b rows.
        self.input_ids = torch.zeros(size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(size, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((size,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(size, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(size + 1, dtype=torch.int32, device=device)  # one token per row, always
        self.block_tables = torch.zeros(size, self.max_blocks, dtype=torch.int32, device=device)
        # The one static output: bucket b writes its first b rows. Made here, outside any capture, so that it
        # is not in the graphs' pool (which then holds no bucket's output).
        self.logits: torch.Tensor | None = torch.empty(size, model.config.vocab_size, dtype=model.dtype,
                                                       device=device)  # (largest bucket, vocab)
        self._runs: dict[int, Callable[[], None]] = {}  # bucket -> replays the step
        self._graphs: list[torch.cuda.CUDAGraph] = []
        self.pool: tuple[int, int] | None = None  # the graphs' private memory pool, once captured

    def capture(self) -> None:
        """Capture (or, with replay="eager", prepare) every bucket, largest first, in one memory pool."""
        if self.replay_mode == "eager":
            self._runs = {size: self._step_function(size) for size in reversed(self.sizes)}
            return
        device = self.model.device
        with torch.cuda.device(device):
            self.pool = pool = torch.cuda.graph_pool_handle()
            stream = torch.cuda.Stream(device)  # capture cannot run on the default stream
            stream.wait_stream(torch.cuda.current_stream(device))  # the pool and weights are ready
            for size in reversed(self.sizes):
                step = self._step_function(size)
                with torch.cuda.stream(stream):
                    step()  # warm-up outside the graph: compiles kernels, runs lazy initialization
                stream.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    step()
                self._graphs.append(graph)
                self._runs[size] = graph.replay
            torch.cuda.current_stream(device).wait_stream(stream)
        logger.info("captured decode steps for batch sizes %s", ", ".join(map(str, self.sizes)))

    def static_bytes(self) -> int:
        """Bytes of the static buffers, inputs and the shared output (`GraphMemory.static_*` estimates them)."""
        buffers = (self.input_ids, self.positions, self.slot_mapping, self.seq_lens, self.query_start_loc,
                   self.block_tables, self.logits)
        return sum(t.numel() * t.element_size() for t in buffers if t is not None)

    def close(self) -> None:
        """Drop the graphs and their static output (their pool goes back to the caching allocator)."""
        self._runs.clear()
        self.logits = None
        for graph in self._graphs:
            graph.reset()
        self._graphs.clear()

    def _step_function(self, size: int) -> Callable[[], None]:
        """The forward pass of a `size`-row decode step over the static buffers, its plan made once here."""
        if self.logits is None:
            raise RuntimeError("these graphs were closed")
        logits = self.logits[:size]  # (size, vocab): a view of the shared static output
        metadata = AttentionMetadata(
            block_size=self.block_size,
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            slot_mapping=self.slot_mapping[:size],
            query_lens_host=(1,) * size,
            # The plan is made for the longest sequence the engine allows; the kernels read the real lengths.
            seq_lens_host=(self.max_model_len,) * size,
            block_tables_host=((0,) * self.max_blocks,) * size,
        )
        kv = PagedAttentionStep(self.kv_cache, self.backend, metadata)  # plan() runs now, once
        input_ids, positions = self.input_ids[None, :size], self.positions[None, :size]  # (1, size)

        def step() -> None:
            hidden = self.model(input_ids, kv, positions)  # (1, size, hidden)
            # The head's output is a temporary of the pool, freed once copied (so a later capture reuses its
            # memory); the static output is what outlives the replay. The copy costs one pass over (size, vocab).
            logits.copy_(self.model.compute_logits(hidden[0]))

        return step

    def bucket_for(self, num_seqs: int) -> int | None:
        """The smallest bucket that holds `num_seqs` rows; None when there is none."""
        index = bisect.bisect_left(self.sizes, num_seqs)
        return self.sizes[index] if index < len(self.sizes) else None

    def can_run(self, model_input: ModelInput) -> bool:
        """Whether this step is a decode-only step that a captured bucket holds."""
        metadata = model_input.metadata
        num_seqs = metadata.num_seqs
        return (0 < num_seqs <= self.sizes[-1]
                and model_input.num_tokens == num_seqs  # one new token per sequence: decodes only
                and len(model_input.sampling_items) == num_seqs
                and metadata.block_tables.shape[1] <= self.max_blocks
                and metadata.max_seq_len <= self.max_model_len)

    def run(self, model_input: ModelInput) -> torch.Tensor:
        """Copy the step into the static buffers, replay its bucket, return logits (num_seqs, vocab): a view of
        the static output, overwritten by the next run (the sampler reads it before then)."""
        if not self._runs or self.logits is None:
            raise RuntimeError("capture() first")
        metadata = model_input.metadata
        num_seqs = metadata.num_seqs
        size = self.bucket_for(num_seqs)
        assert size is not None and self.can_run(model_input)
        self.input_ids[:num_seqs].copy_(model_input.input_ids[0])
        self.positions[:num_seqs].copy_(model_input.positions[0])
        self.slot_mapping[:num_seqs].copy_(metadata.slot_mapping)
        self.slot_mapping[num_seqs:size].fill_(-1)  # padding rows write nowhere ...
        self.seq_lens[:num_seqs].copy_(metadata.seq_lens)
        self.seq_lens[num_seqs:size].fill_(1)  # ... and read one key of whatever block their table row names
        width = metadata.block_tables.shape[1]
        self.block_tables[:num_seqs, :width].copy_(metadata.block_tables)  # columns past width: never read
        if self.replay_mode == "graph":
            with torch.cuda.device(self.model.device):
                self._runs[size]()
        else:
            self._runs[size]()
        self.num_replays += 1
        return self.logits[:num_seqs]
