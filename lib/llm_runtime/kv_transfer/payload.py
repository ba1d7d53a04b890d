"""A prompt's KV blocks as one server ships them to another (lesson 18): the bytes as the pool holds them, and
what the receiver must check before it takes them as its own.

A block of the paged pool (attention/kv_cache.py) holds the keys and values of `block_size` consecutive tokens,
per layer, in the pool's storage dtype: the model's dtype, or 8 bits (int8 with a scale and zero per layer, KV
head and channel; fp8). The bytes mean the same thing in another pool only when everything that produced and
reads them is the same: the model (its config and its weights), the dtype, the block size, the pool's storage
and, for int8, the scales. `KVLayout` is that list; a receiver whose own layout differs refuses the payload with
the first difference (a wrong block would be wrong text, never an error, so it must never get in).

A payload holds whole blocks only, of tokens the sender computed: the receiver names them in its prefix cache by
those tokens (engine/block_manager.py), so a request whose prompt starts with them finds them cached, and only
its tail (at least its last token, whose logits it samples from) is computed there.

On the wire (`to_frames` / `from_frames`): a JSON header, then the keys' bytes and the values' bytes, each one
contiguous (layers, blocks, block_size, KV heads, head_dim) tensor: two large frames, no per-block framing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any

import torch

from ..attention.kv_cache import PagedKVCache

_STORAGE = {str(dtype).removeprefix("torch."): dtype for dtype in (
    torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.float8_e4m3fn)}


def model_fingerprint(model: torch.nn.Module) -> str:
    """A digest of a model's shape and of some of its weights' values: equal for two loads of one checkpoint
    in one dtype, different for another checkpoint (or the same one quantized otherwise). It reads the first
    row of every parameter, which is cheap and covers every tensor."""
    digest = hashlib.sha256(repr(getattr(model, "config", None)).encode())
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            row = parameter.detach().reshape(-1)[: parameter.shape[-1] if parameter.dim() else 1].cpu()
            digest.update(name.encode() + str(tuple(parameter.shape)).encode() + str(parameter.dtype).encode())
            digest.update(row.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:32]


def scales_fingerprint(cache: PagedKVCache) -> str | None:
    """A digest of an int8 pool's scales and zeros (None for a pool without them)."""
    if cache.kv_scales is None:
        return None
    digest = hashlib.sha256()
    for scale in (*cache.kv_scales.keys, *cache.kv_scales.values):
        for tensor in (scale.scale, scale.zero):
            digest.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:32]


@dataclass(frozen=True)
class KVLayout:
    """What a pool's block bytes mean: a receiver takes blocks only from a sender of the same layout."""

    model: str  # model_fingerprint
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # the model's dtype: what attention reads the blocks back in
    storage: str  # the pool's element dtype
    kv_cache_dtype: str  # "auto", "int8" or "fp8"
    scales: str | None = None  # scales_fingerprint of an int8 pool

    @classmethod
    def of(cls, model: torch.nn.Module, cache: PagedKVCache, fingerprint: str | None = None) -> "KVLayout":
        """The layout of `cache`, the pool of `model` (`fingerprint`: model_fingerprint(model), if known)."""
        keys = cache.keys[0]
        return cls(fingerprint or model_fingerprint(model), len(cache.keys), keys.shape[2], keys.shape[3],
                   cache.block_size, str(cache.dtype).removeprefix("torch."),
                   str(keys.dtype).removeprefix("torch."), cache.quantization.name, scales_fingerprint(cache))

    def mismatch(self, other: "KVLayout") -> str | None:
        """None when blocks of `other`'s layout mean the same in this one; else the first difference."""
        names = {"model": "model (its config or weights)", "scales": "int8 scales"}
        # The plain settings first, the model's digest last (another dtype changes the digest too).
        for name in ("block_size", "dtype", "storage", "kv_cache_dtype", "num_layers", "num_kv_heads", "head_dim",
                     "scales", "model"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                return f"the sender's {names.get(name, name)} is {theirs!r}, this pool's is {mine!r}"
        return None


@dataclass
class KVPayload:
    """The KV of a prompt's leading `num_tokens` tokens (whole blocks): `keys`, `values` (layers, blocks,
    block_size, KV heads, head_dim) in the pool's storage dtype, on the CPU; `transfer_id` names it for the
    request that will use it."""

    transfer_id: str
    layout: KVLayout
    token_ids: list[int]
    keys: torch.Tensor
    values: torch.Tensor

    def __post_init__(self) -> None:
        expected = (self.layout.num_layers, len(self.token_ids) // self.layout.block_size, self.layout.block_size,
                    self.layout.num_kv_heads, self.layout.head_dim)
        if len(self.token_ids) % self.layout.block_size:
            raise ValueError(f"a payload holds whole blocks: {len(self.token_ids)} tokens are not a multiple of "
                             f"the block size {self.layout.block_size}")
        for name, tensor in (("keys", self.keys), ("values", self.values)):
            if tuple(tensor.shape) != expected or str(tensor.dtype).removeprefix("torch.") != self.layout.storage:
                raise ValueError(f"the payload's {name} are {tuple(tensor.shape)} {tensor.dtype}; its layout says "
                                 f"{expected} {self.layout.storage}")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_blocks(self) -> int:
        return self.num_tokens // self.layout.block_size

    @property
    def nbytes(self) -> int:
        """The bytes of keys and values shipped."""
        return 2 * self.keys.numel() * self.keys.element_size()

    def to_frames(self) -> list[bytes | memoryview]:
        """The payload as three frames: a JSON header, the keys' bytes, the values' bytes."""
        header = {"transfer_id": self.transfer_id, "layout": dataclasses.asdict(self.layout),
                  "token_ids": self.token_ids}
        return [json.dumps(header).encode(), _raw(self.keys), _raw(self.values)]

    @classmethod
    def from_frames(cls, frames: list[Any]) -> "KVPayload":
        """The payload `to_frames` made; ValueError for frames that are not one (a foreign or cut message)."""
        if len(frames) != 3:
            raise ValueError(f"a KV payload is 3 frames, got {len(frames)}")
        try:
            header = json.loads(bytes(frames[0]))
            layout = KVLayout(**header["layout"])
            token_ids = [int(t) for t in header["token_ids"]]
            transfer_id = str(header["transfer_id"])
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"a KV payload's header is not valid: {error}") from error
        if layout.storage not in _STORAGE:
            raise ValueError(f"a KV payload stored as {layout.storage!r}, which no pool holds")
        storage = _STORAGE[layout.storage]
        shape = (layout.num_layers, len(token_ids) // max(layout.block_size, 1), layout.block_size,
                 layout.num_kv_heads, layout.head_dim)
        keys, values = (_tensor(frame, storage, shape) for frame in frames[1:])
        return cls(transfer_id, layout, token_ids, keys, values)


def _raw(tensor: torch.Tensor) -> memoryview:
    """A CPU tensor's bytes, without a copy."""
    return memoryview(tensor.contiguous().view(torch.uint8).numpy())


def _tensor(frame: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    data = memoryview(frame).cast("B")
    expected = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if data.nbytes != expected:
        raise ValueError(f"a KV payload's frame holds {data.nbytes} bytes; its header says {expected}")
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


def read_blocks(cache: PagedKVCache, blocks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The pool's `blocks` as stored, every layer: keys and values (layers, blocks, block_size, KV, d), on the CPU.
    (Through byte views: index operations exist for bytes whatever the pool's storage, fp8 included.)"""
    index = torch.tensor(blocks, dtype=torch.long, device=cache.keys[0].device)
    storage = cache.keys[0].dtype
    keys = torch.stack([layer.view(torch.uint8).index_select(0, index) for layer in cache.keys]).cpu()
    values = torch.stack([layer.view(torch.uint8).index_select(0, index) for layer in cache.values]).cpu()
    return keys.view(storage), values.view(storage)


def write_blocks(cache: PagedKVCache, blocks: list[int], keys: torch.Tensor, values: torch.Tensor) -> None:
    """Store keys, values (layers, len(blocks), block_size, KV, d) into the pool's `blocks`, every layer."""
    if not blocks:
        return
    index = torch.tensor(blocks, dtype=torch.long, device=cache.keys[0].device)
    for layer, (k, v) in enumerate(zip(keys, values)):
        for pool, part in ((cache.keys[layer], k), (cache.values[layer], v)):
            pool.view(torch.uint8).index_copy_(0, index, part.contiguous().view(torch.uint8).to(pool.device))
