"""The KV cache: keys and values of every past token, kept so each decode step computes one token.

`ContiguousKVCache` is the simplest layout: one preallocated tensor per layer, filled left to right.
`PagedKVCache` is the engine's: one pool of fixed-size blocks that every sequence draws from.
The model talks to any cache through two calls (the `KVCache` protocol): `attend` and `advance`;
batched and paged caches sit behind the same two calls (`torch_gather.PagedKVBatch`).

How much memory a cache takes is arithmetic on the config: `kv_block_bytes` and `num_blocks_in`.
The paged pool can hold its keys and values in 8 bits (`kv_cache_dtype`, `kv_quant.py`).
"""

from __future__ import annotations

from typing import Protocol

import torch

from .causal import causal_attention
from .kv_quant import ChannelScale, KeyTurns, KVQuantization, KVScales, QuantizedPools
from ..config import ModelConfig, RopeConfig


class KVCache(Protocol):
    """What the model's forward needs from a cache: attend over the past, then remember the new tokens."""

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store this step's k, v for `layer_idx` and return attention of q over all keys so far."""
        ...

    def advance(self, num_new_tokens: int) -> None:
        """Called once per forward, after every layer has attended."""
        ...


class ContiguousKVCache:
    """Per layer, K and V of shape (batch, num_kv_heads, max_seq_len, head_dim).

    Invariant: positions [0, num_tokens) of every row hold real keys and values; the rest is unused.
    A forward pass writes its T new tokens into every layer (`attend` calls `update`), then calls
    `advance(T)` once.
    """

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        max_seq_len: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if min(num_layers, batch_size, max_seq_len, num_kv_heads, head_dim) < 1:
            raise ValueError("every KV cache dimension must be >= 1")
        shape = (batch_size, num_kv_heads, max_seq_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_seq_len = max_seq_len
        self.num_tokens = 0
        # Padded batches (static batching) mark which slots hold real tokens: (batch, max_seq_len).
        # None means every filled slot is real.
        self.key_mask: torch.Tensor | None = None

    @classmethod
    def for_model(
        cls,
        config: ModelConfig,
        batch_size: int,
        max_seq_len: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> "ContiguousKVCache":
        """A cache shaped for `config`, reserving `max_seq_len` positions per row."""
        return cls(config.num_layers, batch_size, max_seq_len, config.num_kv_heads, config.head_dim,
                   dtype=dtype, device=device)

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's k, v (B, num_kv_heads, T, head_dim); return all of them so far (B, kv, S, d)."""
        start, end = self.num_tokens, self.num_tokens + k.shape[2]
        if end > self.max_seq_len:
            raise ValueError(f"KV cache full: {end} tokens do not fit in max_seq_len={self.max_seq_len}")
        self.keys[layer_idx][:, :, start:end] = k
        self.values[layer_idx][:, :, start:end] = v
        return self.keys[layer_idx][:, :, :end], self.values[layer_idx][:, :, :end]

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (B, H, T, d) for the T tokens after the cached ones; k, v (B, KV, T, d). -> (B, H, T, d)."""
        num_cached = self.num_tokens
        keys, values = self.update(layer_idx, k, v)  # (B, KV, num_cached + T, d)
        key_mask = None if self.key_mask is None else self.key_mask[:, : keys.shape[2]]
        return causal_attention(q, keys, values, num_cached, key_mask=key_mask)

    def advance(self, num_new_tokens: int) -> None:
        """Mark `num_new_tokens` more positions as filled (after every layer has written them)."""
        self.num_tokens += num_new_tokens

    @property
    def nbytes(self) -> int:
        """Bytes reserved, used or not."""
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    @property
    def nbytes_used(self) -> int:
        """Bytes that hold real tokens."""
        return self.nbytes * self.num_tokens // self.max_seq_len


class PagedKVCache:
    """The KV pool of a paged cache: per layer, K and V of shape (num_blocks, block_size, num_kv_heads, head_dim).

    Which blocks belong to which sequence is the BlockManager's business; this class only stores.
    Token t of a sequence lives at flat slot table[t // block_size] * block_size + t % block_size.
    With `kv_cache_dtype` "int8" or "fp8" the pools hold 8-bit elements (`quantization.storage`); an int8
    pool reads them through `kv_scales`, a scale and zero per layer, KV head and channel (`kv_quant.py`,
    measured by `kv_calibration.calibrate_kv_scales`), and stores keys turned back by the rotary
    embedding of `rope` (`key_turns`), so writing and reading its keys takes their positions. `dtype`
    stays the model's, the dtype attention reads them back in.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        kv_cache_dtype: str = "auto",
        kv_scales: KVScales | None = None,
        rope: RopeConfig | None = None,
    ) -> None:
        if min(num_layers, num_blocks, block_size, num_kv_heads, head_dim) < 1:
            raise ValueError("every paged KV cache dimension must be >= 1")
        self.quantization = quantization = KVQuantization.of(kv_cache_dtype, dtype)
        if quantization.scaled:
            _check_scales(kv_scales, num_layers, num_kv_heads, head_dim)
        elif kv_scales is not None:
            raise ValueError(f"a {kv_cache_dtype!r} pool takes no kv_scales")
        self.kv_scales = None if kv_scales is None else kv_scales.to(device)
        # int8 keys are stored turned back by the model's rotary embedding (kv_quant.py): by the angles its
        # scales were measured with, so that one range holds at every position.
        if quantization.turns_keys and rope is None:
            raise ValueError("an int8 pool stores keys turned back by the model's rotary embedding: give its "
                             "rope (PagedKVCache.for_model does)")
        self.key_turns = KeyTurns.of(rope, head_dim, device) if rope is not None and quantization.turns_keys else None
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.keys = [torch.zeros(shape, dtype=quantization.storage, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=quantization.storage, device=device) for _ in range(num_layers)]
        self.dtype = dtype
        self.num_blocks = num_blocks
        self.block_size = block_size

    @classmethod
    def for_model(
        cls, config: ModelConfig, num_blocks: int, block_size: int, *, dtype: torch.dtype, device: torch.device | str,
        kv_cache_dtype: str = "auto", kv_scales: KVScales | None = None,
    ) -> "PagedKVCache":
        return cls(config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim,
                   dtype=dtype, device=device, kv_cache_dtype=kv_cache_dtype, kv_scales=kv_scales, rope=config.rope)

    @property
    def quantized(self) -> bool:
        return self.quantization.quantized

    def write(self, layer_idx: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              positions: torch.Tensor | None = None) -> None:
        """Store k, v (N, num_kv_heads, head_dim) at flat slots `slot_mapping` (N,), quantized when the
        pool is (an int8 pool needs the tokens' `positions` (N,)); a slot of -1 writes nowhere."""
        self.layer(layer_idx).write(slot_mapping, k, v, positions)

    def scales(self, layer_idx: int) -> tuple[ChannelScale | None, ChannelScale | None]:
        """A layer's key and value scales (an int8 pool's), or (None, None)."""
        if self.kv_scales is None:
            return None, None
        return self.kv_scales.keys[layer_idx], self.kv_scales.values[layer_idx]

    def layer(self, layer_idx: int) -> QuantizedPools:
        """A layer's pools as stored, with their scales."""
        return QuantizedPools(self.quantization, self.keys[layer_idx], self.values[layer_idx], *self.scales(layer_idx),
                              self.key_turns)

    def stored_as(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor,
                  positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v (N, KV, d) at `positions` (N,) as this layer's pools hold them, read back in their dtype."""
        return self.layer(layer_idx).stored_as(k, v, positions)

    def read_blocks(self, layer_idx: int, blocks: torch.Tensor,
                    block_starts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the given blocks (U,), whose first tokens sit at `block_starts` (U,) (an int8
        pool's keys need them), in the model's dtype: (U, block_size, KV, d) each."""
        return self.layer(layer_idx).read_blocks(blocks, block_starts, self.dtype)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate whole blocks (source, destination) in every layer."""
        if not copies:
            return
        sources = torch.tensor([s for s, _ in copies], device=self.keys[0].device)
        destinations = torch.tensor([d for _, d in copies], device=self.keys[0].device)
        for pool in self.keys + self.values:
            pool[destinations] = pool[sources]

    @property
    def nbytes(self) -> int:
        """The pools' bytes (and an int8 pool's table of scales, the same whatever the pool's size)."""
        scales = 0 if self.kv_scales is None else self.kv_scales.nbytes
        return sum(t.numel() * t.element_size() for t in self.keys + self.values) + scales

    def release(self) -> None:
        """Drop the pool's tensors (the engine is shutting down); the cache holds no memory afterwards."""
        self.keys, self.values, self.kv_scales = [], [], None
        self.num_blocks = 0


def _check_scales(kv_scales: KVScales | None, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
    if kv_scales is None:
        raise ValueError("an int8 pool needs kv_scales: calibrate_kv_scales(model) measures them "
                         "(attention/kv_calibration.py), KVScales.uniform gives one range for all")
    shapes = {tuple(s.scale.shape) for s in kv_scales.keys + kv_scales.values} | \
        {tuple(s.zero.shape) for s in kv_scales.keys + kv_scales.values}
    if len(kv_scales.keys) != num_layers or len(kv_scales.values) != num_layers or shapes != {(num_kv_heads, head_dim)}:
        raise ValueError(f"kv_scales must hold {num_layers} layers of ({num_kv_heads}, {head_dim}) scales, got "
                         f"{len(kv_scales.keys)} layers of {sorted(shapes)}")


def kv_block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one block across all layers, K and V: block_size x 2 x layers x kv heads x head dim x the
    bytes of an element as stored."""
    quantization = KVQuantization.of(kv_cache_dtype, dtype)
    if not quantization.quantized:
        return block_size * config.kv_bytes_per_token(torch.empty((), dtype=dtype).element_size())
    return block_size * 2 * config.num_layers * config.num_kv_heads * quantization.head_bytes(config.head_dim)


def num_blocks_in(nbytes: int, config: ModelConfig, block_size: int, dtype: torch.dtype,
                  kv_cache_dtype: str = "auto") -> int:
    """How many whole blocks fit in `nbytes` of memory."""
    return nbytes // kv_block_bytes(config, block_size, dtype, kv_cache_dtype)
