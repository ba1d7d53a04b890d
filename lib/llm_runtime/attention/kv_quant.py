"""A quantized KV cache: keys and values stored in 8 bits, read back in the model's dtype.

The pool is most of an engine's memory, and at long contexts reading it is most of a decode step's
bytes. `EngineConfig(kv_cache_dtype=...)` picks how each key and value element is stored:

- "auto": in the model's dtype (4 bytes an element in float32, 2 in bfloat16).
- "int8": q = round((x - z) / s) in [-127, 127], with a scale s and a zero z per layer, KV head and
  channel, fixed before the first request (`ChannelScale`, `KVScales`): exactly 1 byte an element, 4x
  the tokens of float32 in the same bytes, plus one small table (92 KB for the bundled model). Keys
  need their own range per channel: a few channels of a head are ten times the others and sit off
  zero, whatever the token. The ranges are measured once, on a text run through the model
  (`kv_calibration.py`), with some headroom; an element beyond its channel's range is clamped.
  Within it the error of an element is at most s / 2.
  Keys are stored turned back by the rotary embedding (`KeyTurns`): the model turns each pair of a
  key's channels by an angle that grows with the position, so as turned, a channel's range depends on
  where in the context the key sits, and one range for every position is as wide as a full turn.
  Turned back, the range is the same everywhere: writing turns a key back by its position's angles
  before rounding it, reading turns it again (`QuantizedPools`).
- "fp8": float8 e4m3 (4 exponent bits, 3 mantissa bits, largest 448), no scale: exactly 1 byte an
  element, 4x float32; a relative error of at most 2^-4 per element, whatever its size.

Lesson 13 weighs the other place a scale could live, one per token and KV head: it follows each
token's size and needs no calibration, but its 2 bytes beside 64 make 3.88x instead of 4x.

Writing quantizes (`QuantizedPools.store`). A backend that reads 8-bit keys where they lie (the `cpu`
backend's C kernel: `reads_quantized_kv`, `forward_quantized` over `QuantizedPools`) needs nothing more.
Any other reads through a copy: per step, `compact_step` renumbers the blocks the step's sequences use
(0 .. U-1) and, per layer, `QuantizedPools.read_blocks` turns just those U blocks back into the model's
dtype (keys turned to their positions: a block in column j of a table holds positions j * block_size
onwards), a small pool it reads as it reads the full-precision one. The copy's cost is proportional to
the step's context, not the pool (but for a backend compiled for one pool shape, `reads_whole_pool`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch

from ..config import KV_CACHE_DTYPES, RopeConfig
from .metadata import AttentionMetadata

INT8_MAX = 127
FP8_MAX = 448.0  # the largest finite float8 e4m3fn


@dataclass(frozen=True)
class ChannelScale:
    """One layer's keys (or values) in an int8 pool: element = stored * scale + zero, per KV head and channel."""

    scale: torch.Tensor  # (KV, d) float32, > 0
    zero: torch.Tensor  # (KV, d) float32

    @classmethod
    def spanning(cls, low: torch.Tensor, high: torch.Tensor, headroom: float = 1.0) -> "ChannelScale":
        """The scale whose 255 steps cover [low, high] (KV, d) widened by `headroom` about its middle."""
        if headroom < 1.0:
            raise ValueError(f"headroom must be at least 1, got {headroom}")
        half = (high.float() - low.float()) / 2 * headroom
        half = half.clamp_min(float(half.max()) * 1e-6 + 1e-12)  # a channel that never moved still gets a step
        return cls(half / INT8_MAX, (high.float() + low.float()) / 2)

    def placing(self, point: torch.Tensor) -> "ChannelScale":
        """The same steps moved by less than half a step, so that `point` (KV, d) is one of them exactly."""
        point = point.float()
        return ChannelScale(self.scale, point - self.scale * torch.round((point - self.zero) / self.scale))

    def to(self, device: torch.device | str) -> "ChannelScale":
        return ChannelScale(self.scale.to(device), self.zero.to(device))


@dataclass(frozen=True)
class KVScales:
    """An int8 pool's scales, per layer: `keys[layer]` and `values[layer]`."""

    keys: tuple[ChannelScale, ...]
    values: tuple[ChannelScale, ...]

    @classmethod
    def uniform(cls, num_layers: int, num_kv_heads: int, head_dim: int, bound: float) -> "KVScales":
        """Every channel of every layer over [-bound, bound]: for tests, and for a pool with nothing to calibrate on."""
        edge = torch.full((num_kv_heads, head_dim), float(bound))
        scale = ChannelScale.spanning(-edge, edge)
        return cls((scale,) * num_layers, (scale,) * num_layers)

    def to(self, device: torch.device | str) -> "KVScales":
        return KVScales(tuple(s.to(device) for s in self.keys), tuple(s.to(device) for s in self.values))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self.keys + self.values for t in (s.scale, s.zero))


class KeyTurns:
    """The rotary embedding's turns, undone before an int8 pool stores a key and redone when it is read.

    The model turns each pair of a key's channels (i, i + d/2) by the angle position * inv_freq[i]
    (model/rope.py; the frequencies: config.py's RopeConfig). `turn` does the same to keys at given positions, or undoes it (`back`), in
    float32; `tables` are the cosines and sines of every position up to a length, for the C kernel,
    computed once and grown when a longer sequence comes.
    """

    def __init__(self, inv_freq: torch.Tensor) -> None:
        self.inv_freq = inv_freq.float()  # (d/2,)
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def of(cls, rope: RopeConfig, head_dim: int, device: torch.device | str = "cpu") -> "KeyTurns":
        """The turns of a model with this rotary embedding and head size."""
        return cls(rope.inverse_frequencies(head_dim).to(device))

    def angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (...) -> cos, sin (..., d/2) float32: as the model's RotaryEmbedding computes them."""
        freqs = positions[..., None].float() * self.inv_freq  # (..., d/2)
        return freqs.cos(), freqs.sin()

    def turn(self, x: torch.Tensor, positions: torch.Tensor, *, back: bool = False) -> torch.Tensor:
        """x (..., KV, d), positions x's leading dims (...) -> x in float32, each pair of channels turned
        by its position's angles (`back`: by minus them)."""
        cos, sin = self.angles(positions)
        cos, sin = cos[..., None, :], sin[..., None, :]  # (..., 1, d/2): the same for every KV head
        if back:
            sin = -sin
        x = x.float()
        half = x.shape[-1] // 2
        first, second = x[..., :half], x[..., half:]
        return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)

    def tables(self, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (P, d/2) float32, contiguous, for positions 0 .. P - 1, P at least `num_positions`."""
        held = 0 if self._tables is None else self._tables[0].shape[0]
        if held < num_positions:
            size = max(num_positions, 2 * held, 1024)
            cos, sin = self.angles(torch.arange(size, device=self.inv_freq.device))
            self._tables = (cos.contiguous(), sin.contiguous())
        assert self._tables is not None
        return self._tables


@dataclass(frozen=True)
class KVQuantization:
    """How one element of the pool is stored: in `storage`, with a `ChannelScale` (int8) or as it is."""

    name: str  # one of KV_CACHE_DTYPES
    storage: torch.dtype

    @classmethod
    def of(cls, kv_cache_dtype: str, model_dtype: torch.dtype) -> "KVQuantization":
        if kv_cache_dtype == "auto":
            return cls("auto", model_dtype)
        if kv_cache_dtype == "int8":
            return cls("int8", torch.int8)
        if kv_cache_dtype == "fp8":
            return cls("fp8", torch.float8_e4m3fn)
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")

    @property
    def quantized(self) -> bool:
        return self.name != "auto"

    @property
    def scaled(self) -> bool:
        """Whether stored elements need a `ChannelScale` to be read."""
        return self.name == "int8"

    @property
    def turns_keys(self) -> bool:
        """Whether keys are stored turned back to where the rotary embedding found them (`KeyTurns`)."""
        return self.name == "int8"

    def head_bytes(self, head_dim: int) -> int:
        """Bytes of one KV head of one token."""
        return head_dim * torch.empty((), dtype=self.storage).element_size()

    def quantize(self, x: torch.Tensor, scale: ChannelScale | None = None) -> torch.Tensor:
        """x (..., KV, d) -> the stored values, same shape (int8: `scale` broadcast over the leading dims)."""
        if not self.quantized:
            return x
        if self.name == "fp8":
            return x.float().clamp(-FP8_MAX, FP8_MAX).to(self.storage)
        if scale is None:
            raise ValueError("an int8 pool needs its scales")
        return torch.round((x.float() - scale.zero) / scale.scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)

    def dequantize(self, stored: torch.Tensor, scale: ChannelScale | None, dtype: torch.dtype) -> torch.Tensor:
        """The inverse of `quantize`, in `dtype`."""
        if self.name != "int8":  # the model's dtype, or float8
            return stored.to(dtype)
        if scale is None:
            raise ValueError("an int8 pool needs its scales")
        return (stored.float() * scale.scale + scale.zero).to(dtype)

    def round_trip(self, x: torch.Tensor, scale: ChannelScale | None = None) -> torch.Tensor:
        """x as the pool stores it, read back in x's dtype."""
        return self.dequantize(self.quantize(x, scale), scale, x.dtype) if self.quantized else x


@dataclass(frozen=True)
class QuantizedPools:
    """One layer's 8-bit pools as stored, and how to store into them and read them back."""

    quantization: KVQuantization
    key_pool: torch.Tensor  # (num_blocks, block_size, KV, d) int8 or float8_e4m3fn
    value_pool: torch.Tensor
    key_scale: ChannelScale | None  # int8's; None for fp8
    value_scale: ChannelScale | None
    key_turns: KeyTurns | None = None  # int8's: keys are stored turned back by their positions' angles

    def __post_init__(self) -> None:
        if self.quantization.turns_keys and self.key_turns is None:
            raise ValueError(f"{self.quantization.name} pools store keys turned back: they need the model's key_turns")

    def store(self, key: torch.Tensor, value: torch.Tensor,
              positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """key, value (N, KV, d) at `positions` (N,) (needed where keys are turned) -> as the pools hold them."""
        if self.key_turns is not None:
            key = self.key_turns.turn(key, _needed(positions), back=True)
        return self.quantization.quantize(key, self.key_scale), self.quantization.quantize(value, self.value_scale)

    def write(self, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              positions: torch.Tensor | None = None) -> None:
        """Store key, value (N, KV, d) at `positions` (N,) into flat slots `slot_mapping` (N,); -1 writes nowhere."""
        keep = slot_mapping >= 0
        if not bool(keep.all()):
            slot_mapping, key, value = slot_mapping[keep], key[keep], value[keep]
            positions = None if positions is None else positions[keep]
        for pool, stored in zip((self.key_pool, self.value_pool), self.store(key, value, positions)):
            pool.view(-1, *stored.shape[1:])[slot_mapping] = stored  # (num_blocks * block_size, KV, d)

    def stored_as(self, key: torch.Tensor, value: torch.Tensor,
                  positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """key, value (N, KV, d) at `positions` as the pools store them, read back in their dtype."""
        if not self.quantization.quantized:
            return key, value
        stored_key, stored_value = self.store(key, value, positions)
        return (self._read_keys(stored_key, positions, key.dtype),
                self.quantization.dequantize(stored_value, self.value_scale, value.dtype))

    def read_blocks(self, blocks: torch.Tensor, block_starts: torch.Tensor | None,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Pool blocks (U,) whose first tokens sit at positions `block_starts` (U,) (needed where keys are
        turned) -> their keys and values in `dtype`, (U, block_size, KV, d) each."""
        positions = None
        if self.key_turns is not None:
            offsets = torch.arange(self.key_pool.shape[1], device=blocks.device)
            positions = _needed(block_starts)[:, None] + offsets  # (U, block_size)
        return (self._read_keys(self.key_pool[blocks], positions, dtype),
                self.quantization.dequantize(self.value_pool[blocks], self.value_scale, dtype))

    def _read_keys(self, stored: torch.Tensor, positions: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        if self.key_turns is None:
            return self.quantization.dequantize(stored, self.key_scale, dtype)
        turned_back = self.quantization.dequantize(stored, self.key_scale, torch.float32)
        return self.key_turns.turn(turned_back, _needed(positions)).to(dtype)


def _needed(positions: torch.Tensor | None) -> torch.Tensor:
    if positions is None:
        raise ValueError("an int8 pool stores keys turned back by their positions' rotary angles: "
                         "give the keys' positions")
    return positions


@dataclass(frozen=True)
class CompactStep:
    """A step's metadata over its own blocks only: `blocks[i]` of the pool is block i of the small pool."""

    metadata: AttentionMetadata
    blocks: torch.Tensor  # (U,) int64: pool blocks the step reads or writes, ascending
    block_starts: torch.Tensor  # (U,) int64: the position of each one's first token (0 where none is read)


def compact_step(metadata: AttentionMetadata, whole_pool: int | None = None) -> CompactStep:
    """Renumber the blocks of the step's tables 0 .. U-1 (tables, slots, and their host copies). With
    `whole_pool` (the pool's block count), every block instead, numbered as it is: for a backend compiled
    for one pool size (flex), which then reads the whole pool back every layer."""
    tables = metadata.block_tables  # (B, max_blocks) int32
    starts = metadata.block_starts()
    if whole_pool is not None:
        return CompactStep(metadata, torch.arange(whole_pool, device=tables.device),
                           _starts_of(range(whole_pool), starts, tables.device))
    used = sorted(set(starts) | {0})  # 0: tables' padding
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
    return CompactStep(compact, blocks, _starts_of(used, starts, tables.device))


def _starts_of(blocks: Iterable[int], starts: dict[int, int], device: torch.device) -> torch.Tensor:
    return torch.tensor([starts.get(block, 0) for block in blocks], dtype=torch.int64, device=device)
