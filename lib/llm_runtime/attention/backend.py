"""The attention-backend interface: how a layer writes this step's keys and values and attends.

A backend sees the whole ragged batch at once (prefill chunks and decodes together) and the
layer's slice of the paged pool. Per step, `plan` turns the step's `AttentionMetadata` into
whatever the backend wants precomputed (masks, groups, padded tables), once for all layers; per
layer, `store_kv` writes the new keys and values through the slot mapping and `forward` attends.
`PagedAttentionStep` is what the model runner hands the model: it holds the pool, the backend and
the plan, and speaks the model's `KVCache` protocol (`attend`, `advance`).

Shapes follow vLLM's: queries (N, num_heads, head_dim), new keys and values (N, num_kv_heads,
head_dim), pools (num_blocks, block_size, num_kv_heads, head_dim), outputs (N, num_heads, head_dim).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Protocol

import torch

from .kv_cache import PagedKVCache
from .kv_quant import QuantizedPools, compact_step
from .metadata import AttentionMetadata


class AttentionBackend(ABC):
    """Paged attention for a ragged batch. Invariant: `forward` is causal within each sequence, reads
    only the first seq_lens[b] slots of sequence b's blocks, and its output does not depend on
    what the pool holds anywhere else."""

    name: ClassVar[str]
    # True when a decode step can be captured in a CUDA graph (worker/cuda_graphs.py): `plan` decides
    # everything from the host-side shapes it is given (the graph keeps that decision), `store_kv` and
    # `forward` launch kernels that read the device tensors only, with no host synchronization, and a
    # padded row (slot -1, one key) writes nowhere.
    supports_cuda_graphs: ClassVar[bool] = False
    # True when `forward` needs the pool's shape fixed for the engine's life (a compiled kernel): a quantized
    # pool is then read back whole each layer instead of the step's blocks alone (kv_quant.py).
    reads_whole_pool: ClassVar[bool] = False
    # True when the backend reads an 8-bit pool where it lies (`forward_quantized`); otherwise a quantized
    # pool reaches `forward` as a full-precision copy of the step's blocks (kv_quant.py).
    reads_quantized_kv: ClassVar[bool] = False

    @classmethod
    def is_available(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        """None when this backend can run here; otherwise the reason it cannot."""
        return None

    @classmethod
    def batch_invariant(cls) -> "AttentionBackend":
        """This backend set up so that a query row's output does not depend on the rest of its step (its keys
        summed in one order, the same for a decode row and a prefill row at the same position): lesson 16.
        ValueError where the backend has no such setting."""
        raise ValueError(f"attention backend {cls.name!r} has no batch-invariant mode: it reduces a row in an order "
                         f"that depends on its chunk or its batch")

    @classmethod
    def supports_block_size(cls, block_size: int) -> str | None:
        """None when this backend reads pools of `block_size`-token blocks; otherwise why not."""
        return None

    @classmethod
    def supports_block_size_on(cls, device: torch.device, block_size: int) -> str | None:
        """`supports_block_size` on `device`, for a backend whose rule depends on it (flex: any block on the
        CPU, multiples of 16 tokens on CUDA); what the selector asks."""
        return cls.supports_block_size(block_size)

    def decode_workspace_bytes(self, num_seqs: int, max_seq_len: int, num_heads: int, head_dim: int) -> int:
        """Bytes of scratch memory a decode step of `num_seqs` sequences up to `max_seq_len` keys allocates
        beyond its output (what a CUDA graph of that step keeps in its pool); 0 when nothing to speak of."""
        return 0

    def plan(self, metadata: AttentionMetadata) -> Any:
        """Per step, before the first layer: whatever this backend precomputes from the metadata."""
        return metadata

    def store_kv(
        self,
        key_pool: torch.Tensor,
        value_pool: torch.Tensor,
        slot_mapping: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
    ) -> None:
        """Write key, value (N, num_kv_heads, head_dim) at flat slots `slot_mapping` (N,); -1 writes nowhere."""
        num_slots = key_pool.shape[0] * key_pool.shape[1]
        slots = torch.where(slot_mapping < 0, num_slots, slot_mapping)  # padding goes out of range ...
        keep = slots < num_slots
        if not bool(keep.all()):  # ... and is dropped (only padded batches pay for this check)
            slots, key, value = slots[keep], key[keep], value[keep]
        key_pool.view(num_slots, *key.shape[1:])[slots] = key  # (num_blocks * block_size, KV, d)
        value_pool.view(num_slots, *value.shape[1:])[slots] = value

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_pool: torch.Tensor,
        value_pool: torch.Tensor,
        plan: Any,
    ) -> torch.Tensor:
        """query (N, num_heads, head_dim) -> (N, num_heads, head_dim), each row attending causally over
        its own sequence's keys in the pool. This step's key, value (N, num_kv_heads, head_dim) are
        already stored there; a backend may read them from these arguments instead."""


    def store_quantized(self, pools: QuantizedPools, slot_mapping: torch.Tensor, key: torch.Tensor,
                        value: torch.Tensor, positions: torch.Tensor | None) -> None:
        """Store this step's key, value (N, KV, d) at `positions` (N,) into a layer's 8-bit pools at flat slots
        `slot_mapping` (-1 writes nowhere), quantized (kv_quant.py). A backend may do it in one call."""
        pools.write(slot_mapping, key, value, positions)

    def forward_quantized(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, pools: QuantizedPools,
                          plan: Any) -> torch.Tensor:
        """As `forward`, over a layer's 8-bit pools as stored (only where `reads_quantized_kv`). key and value
        (N, KV, d) are this step's, already stored, in full precision: a backend that reads them instead of
        the pool rounds them as stored first (`pools.stored_as`, with the step's positions for int8's keys,
        which its plan can hold), so that every row sees the same keys whichever path serves it."""
        raise NotImplementedError(f"the {self.name} backend does not read quantized pools in place")


    def compiled_inputs(self, plan: Any, num_blocks: int) -> tuple[torch.Tensor, ...] | None:
        """Where this step's attention can run inside a torch.compile graph (worker/compiled_forward.py): the
        tensors of the plan that `attend_compiled` reads in every layer, checked against pools of `num_blocks`
        blocks. None where the step must run eagerly (the default: a backend that decides on the host)."""
        return None

    def attend_compiled(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_pool: torch.Tensor,
                        value_pool: torch.Tensor, slot_mapping: torch.Tensor, *plan: torch.Tensor) -> torch.Tensor:
        """`store_kv`, then `forward`, in one layer of a compiled forward pass, over the tensors `compiled_inputs`
        gave: operators the tracer can follow, with no decision on the host."""
        raise NotImplementedError(f"the {self.name} backend does not run inside a compiled forward pass")


class AttentionTimer(Protocol):
    attention: float  # seconds spent in attention layers so far (the engine's StepProfile)


class PagedAttentionStep:
    """One step's attention state, shared by every layer: the pool, the backend and its plan.

    Implements the model's `KVCache` protocol, so the model's forward does not know which backend runs.
    """

    def __init__(self, cache: PagedKVCache, backend: AttentionBackend, metadata: AttentionMetadata,
                 timer: AttentionTimer | None = None) -> None:
        if metadata.block_size != cache.block_size:
            raise ValueError(f"metadata for block size {metadata.block_size}, pool of {cache.block_size}")
        self.cache = cache
        self.backend = backend
        self.metadata = metadata
        self.timer = timer
        started = time.perf_counter()
        # A quantized pool is read through a small full-precision copy of the step's own blocks (kv_quant.py).
        whole_pool = cache.num_blocks if backend.reads_whole_pool else None
        self.compact = compact_step(metadata, whole_pool) if cache.quantized and not backend.reads_quantized_kv \
            else None
        self.plan = backend.plan(metadata if self.compact is None else self.compact.metadata)
        # An int8 pool stores keys turned back by their positions' rotary angles (kv_quant.py).
        self.positions = metadata.token_positions() if cache.quantization.turns_keys else None
        if timer is not None:
            timer.attention += time.perf_counter() - started

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (1, H, N, d), k, v (1, KV, N, d) -> (1, H, N, d): store this step's k, v, then attend."""
        started = time.perf_counter()
        key_pool, value_pool = self.cache.keys[layer_idx], self.cache.values[layer_idx]
        key, value = k[0].transpose(0, 1), v[0].transpose(0, 1)  # (N, KV, d)
        query = q[0].transpose(0, 1)  # (N, H, d)
        if not self.cache.quantized:
            self.backend.store_kv(key_pool, value_pool, self.metadata.slot_mapping, key, value)
            out = self.backend.forward(query, key, value, key_pool, value_pool, self.plan)  # (N, H, d)
        else:  # quantize into the pool, attend over it (and over these keys as stored)
            pools = self.cache.layer(layer_idx)
            self.backend.store_quantized(pools, self.metadata.slot_mapping, key, value, self.positions)
            if self.compact is None:  # the backend reads 8 bits where they lie
                out = self.backend.forward_quantized(query, key, value, pools, self.plan)
            else:  # the step's blocks read back: (U, block_size, KV, d) each, and these keys as stored
                key, value = self.cache.stored_as(layer_idx, key, value, self.positions)
                key_pool, value_pool = self.cache.read_blocks(layer_idx, self.compact.blocks, self.compact.block_starts)
                out = self.backend.forward(query, key, value, key_pool, value_pool, self.plan)
        if self.timer is not None:
            self.timer.attention += time.perf_counter() - started
        return out.transpose(0, 1)[None]  # (1, H, N, d)

    def advance(self, num_new_tokens: int) -> None:
        """Nothing to do: the block manager, not the pool, knows how many tokens each sequence has."""
