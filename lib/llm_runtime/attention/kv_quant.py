"""A quantized KV cache: keys and values stored in 8 bits, read back in the model's dtype.

The pool is most of an engine's memory, and at long contexts reading it is most of a decode step's
bytes. `EngineConfig(kv_cache_dtype=...)` picks how each key and value element is stored:

- "auto": in the model's dtype (4 bytes an element in float32, 2 in bfloat16).
- "int8": q = round(x / s) in [-127, 127], one scale s = max |x| / 127 per token and KV head, kept
  in float16 beside the pool: head_dim + 2 bytes per head and token (66 for head_dim 64, against
  256 in float32: 3.88x the tokens in the same bytes). The error of an element is at most s / 2.
- "fp8": float8 e4m3 (4 exponent bits, 3 mantissa bits, largest 448), no scale: exactly 1 byte an
  element, 4x float32; a relative error of at most 2^-4 per element, whatever its size.

Writing quantizes (`KVQuantization.quantize`). A backend that reads 8-bit keys where they lie (the
`cpu` backend's C kernel: `reads_quantized_kv`, `forward_quantized` over `QuantizedPools`) needs nothing
more. Any other reads through a copy: per step, `compact_step` renumbers the blocks the step's sequences
use (0 .. U-1) and, per layer, `dequantize_blocks` turns just those U blocks back into the model's dtype,
a small pool it reads as it reads the full-precision one. The copy's cost is proportional to the step's
context, not the pool (but for a backend compiled for one pool shape, `reads_whole_pool`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..config import KV_CACHE_DTYPES
from .metadata import AttentionMetadata

INT8_MAX = 127
FP8_MAX = 448.0  # the largest finite float8 e4m3fn
SCALE_DTYPE = torch.float16
_SMALLEST_SCALE = 2.0**-24  # float16's smallest subnormal: an all-zero head still gets a usable scale


@dataclass(frozen=True)
class KVQuantization:
    """How one element of the pool is stored: `storage` dtype, with a scale per token and KV head or not."""

    name: str  # one of KV_CACHE_DTYPES
    storage: torch.dtype
    scaled: bool

    @classmethod
    def of(cls, kv_cache_dtype: str, model_dtype: torch.dtype) -> "KVQuantization":
        if kv_cache_dtype == "auto":
            return cls("auto", model_dtype, False)
        if kv_cache_dtype == "int8":
            return cls("int8", torch.int8, True)
        if kv_cache_dtype == "fp8":
            return cls("fp8", torch.float8_e4m3fn, False)
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")

    @property
    def quantized(self) -> bool:
        return self.name != "auto"

    def head_bytes(self, head_dim: int) -> int:
        """Bytes of one KV head of one token: its elements, plus its scale when there is one."""
        element = torch.empty((), dtype=self.storage).element_size()
        return head_dim * element + (torch.empty((), dtype=SCALE_DTYPE).element_size() if self.scaled else 0)

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x (..., head_dim) -> (stored values (..., head_dim), scales (...) or None)."""
        if not self.quantized:
            return x, None
        if self.name == "fp8":
            return x.float().clamp(-FP8_MAX, FP8_MAX).to(self.storage), None
        x = x.float()
        scale = (x.abs().amax(-1) / INT8_MAX).clamp_min(_SMALLEST_SCALE).to(SCALE_DTYPE)  # (...)
        q = torch.round(x / scale.float()[..., None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
        return q, scale

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        """x as the pool stores it, read back in x's dtype."""
        return self.dequantize(*self.quantize(x), x.dtype) if self.quantized else x

    def dequantize(self, stored: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """The inverse of `quantize`, in `dtype`."""
        if scale is None:  # the model's dtype, or float8
            return stored.to(dtype)
        return (stored.float() * scale.float()[..., None]).to(dtype)


@dataclass(frozen=True)
class QuantizedPools:
    """One layer's 8-bit pools as stored, for a backend that reads them in place (`reads_quantized_kv`)."""

    quantization: KVQuantization
    key_pool: torch.Tensor  # (num_blocks, block_size, KV, d) int8 or float8_e4m3fn
    value_pool: torch.Tensor
    key_scales: torch.Tensor | None  # (num_blocks, block_size, KV) float16 for int8; None for fp8
    value_scales: torch.Tensor | None


@dataclass(frozen=True)
class CompactStep:
    """A step's metadata over its own blocks only: `blocks[i]` of the pool is block i of the small pool."""

    metadata: AttentionMetadata
    blocks: torch.Tensor  # (U,) int64: pool blocks the step reads or writes, ascending


def compact_step(metadata: AttentionMetadata, whole_pool: int | None = None) -> CompactStep:
    """Renumber the blocks of the step's tables 0 .. U-1 (tables, slots, and their host copies). With
    `whole_pool` (the pool's block count), every block instead, numbered as it is: for a backend compiled
    for one pool size (flex), which then reads the whole pool back every layer."""
    tables = metadata.block_tables  # (B, max_blocks) int32
    if whole_pool is not None:
        return CompactStep(metadata, torch.arange(whole_pool, device=tables.device))
    used = sorted({block for table in metadata.block_tables_host for block in table} | {0})  # 0: tables' padding
    blocks = torch.tensor(used, dtype=torch.int64, device=tables.device)  # (U,)
    remap = torch.zeros(used[-1] + 1, dtype=torch.int32, device=tables.device)
    remap[blocks] = torch.arange(len(used), dtype=torch.int32, device=tables.device)
    index = {block: i for i, block in enumerate(used)}
    slots, size = metadata.slot_mapping, metadata.block_size
    padded = slots < 0
    real = slots.clamp_min(0)
    new_slots = remap.long()[real // size] * size + real % size  # (N,)
    compact = replace(
        metadata,
        block_tables=remap[tables.long()],
        slot_mapping=torch.where(padded, slots, new_slots),
        block_tables_host=tuple(tuple(index[b] for b in table) for table in metadata.block_tables_host),
    )
    return CompactStep(compact, blocks)


def dequantize_blocks(quantization: KVQuantization, pool: torch.Tensor, scales: torch.Tensor | None,
                      blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """pool (num_blocks, block_size, KV, d) stored, scales (num_blocks, block_size, KV) -> the given
    blocks in `dtype`: (U, block_size, KV, d)."""
    return quantization.dequantize(pool[blocks], None if scales is None else scales[blocks], dtype)
