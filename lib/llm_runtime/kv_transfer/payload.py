"""A prompt's KV blocks as one server ships them to another (lesson 18): the bytes as the pool holds them, and
what the receiver must check before it takes them as its own.

A block of the paged pool (attention/kv_cache.py) holds the keys and values of `block_size` consecutive tokens,
per layer, in the pool's storage dtype: the model's dtype, or 8 bits (int8 with a scale and zero per layer, KV
head and channel; fp8). The bytes mean the same thing in another pool only when everything that produced and
reads them is the same: the model (its config and its weights), the dtype, the block size, the pool's storage
and, for int8, the scales. `KVLayout` is that list; a receiver whose own layout differs refuses the payload with
the first difference (a wrong block would be wrong text, never an error, so it must never get in).

A payload holds whole blocks only, of tokens the sender computed: the receiver names them in its prefix cache by
those tokens (core/block_manager.py), so a request whose prompt starts with them finds them cached, and only
its tail (at least its last token, whose logits it samples from) is computed there.

On the wire (`to_frames` / `from_frames`): a JSON header, then the keys' bytes and the values' bytes, each one
contiguous (layers, blocks, block_size, KV heads, head_dim) tensor: two large frames, no per-block framing (and,
between servers that share a secret, a fourth frame: the MAC over the three, trust.py). The frames come from a
socket, so `from_frames` trusts none of them: the header's size is bounded before it is parsed, every field is
checked for its type and range, the frames' sizes are computed from the header and compared before any tensor is
made, and whatever goes wrong is a ValueError that refuses this message alone. The tensors are views of the
received frames, not copies: the only copy is the one into the pool.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from ..attention.kv_cache import PagedKVCache

_STORAGE = {str(dtype).removeprefix("torch."): dtype for dtype in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.float8_e4m3fn)}


def model_fingerprint(model: torch.nn.Module) -> str:
    """A digest of a model's config and of what its weights are, read from its state dict one module at a time:
    the entries a module saves say what its weights mean, not how it keeps them (a packed linear saves its plain
    weight under its parts' names; a quantized layer its quantized values and scales; the GGUF's Q8_0 table its
    blocks). So two loads of one checkpoint in one dtype and quantization match, packed or not; another checkpoint,
    or the same one quantized otherwise (int8, int4, the GGUF's own blocks), does not. It reads the first, middle
    and last row of every entry, which is cheap and covers every tensor."""
    entries: list[tuple[str, bytes]] = []
    with torch.no_grad():
        for prefix, module in model.named_modules():
            saved: dict[str, Any] = {}
            module._save_to_state_dict(saved, f"{prefix}." if prefix else "", keep_vars=True)  # its own entries
            entries += [(name, _rows_digest(tensor)) for name, tensor in saved.items() if tensor is not None]
    digest = hashlib.sha256(repr(getattr(model, "config", None)).encode())
    for name, rows in sorted(entries):  # by name: a packed model's modules come in another order
        digest.update(name.encode() + rows)
    return digest.hexdigest()[:32]


def _rows_digest(tensor: torch.Tensor) -> bytes:
    """A tensor's shape and dtype, and the bytes of its first, middle and last row (a vector whole)."""
    tensor = tensor.detach()
    header = f"{tuple(tensor.shape)} {tensor.dtype}".encode()
    if tensor.dim() <= 1:
        rows = [tensor.reshape(-1)]
    else:
        rows = [tensor[i].reshape(-1) for i in sorted({0, tensor.shape[0] // 2, tensor.shape[0] - 1})]
    data = b"".join(row.cpu().contiguous().view(torch.uint8).numpy().tobytes() for row in rows)
    return hashlib.sha256(header + data).digest()


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
        """The payload as three frames: a JSON header (with the time it was sent), the keys' bytes, the values'."""
        header = {"transfer_id": self.transfer_id, "layout": dataclasses.asdict(self.layout),
                  "token_ids": self.token_ids, "sent_at": time.time()}
        return [json.dumps(header).encode(), _raw(self.keys), _raw(self.values)]

    @classmethod
    def from_frames(cls, frames: list[Any], max_tokens: int | None = None) -> "KVPayload":
        """The payload `to_frames` made; ValueError for frames that are not one (foreign, cut, malformed, or of
        more than `max_tokens` tokens), whatever they hold."""
        max_tokens = MAX_PAYLOAD_TOKENS if max_tokens is None else max_tokens
        if len(frames) != 3:
            raise ValueError(f"a KV payload is 3 frames, got {len(frames)}")
        header = read_header(frames[0], max_tokens)
        transfer_id, layout = check_transfer_id(header["transfer_id"]), _layout(header["layout"])
        token_ids = header["token_ids"]
        if not isinstance(token_ids, list) or len(token_ids) > max_tokens:
            raise ValueError(f"a KV payload's token_ids must be a list of at most {max_tokens} token ids")
        if not all(type(t) is int and 0 <= t < _MAX_TOKEN_ID for t in token_ids):
            raise ValueError("a KV payload's token_ids must be token ids (integers in [0, 2**31))")
        if len(token_ids) % layout.block_size:
            raise ValueError(f"a payload holds whole blocks: {len(token_ids)} tokens are not a multiple of the block "
                             f"size {layout.block_size}")
        storage = _STORAGE[layout.storage]
        shape = (layout.num_layers, len(token_ids) // layout.block_size, layout.block_size, layout.num_kv_heads,
                 layout.head_dim)
        keys, values = (_tensor(frame, storage, shape) for frame in frames[1:])
        return cls(transfer_id, layout, token_ids, keys, values)


MAX_PAYLOAD_TOKENS = 1 << 20  # what a header may say at most when the receiver gives no bound of its own
_MAX_TOKEN_ID = 1 << 31
_MAX_TOKEN_ID_CHARS = 12  # "2147483647, "
_MAX_HEADER_BYTES = 4096  # the header without its token ids
_HEADER_KEYS = {"transfer_id", "layout", "token_ids", "sent_at"}
_LAYOUT_SIZES = ("num_layers", "num_kv_heads", "head_dim", "block_size")
_LAYOUT_NAMES = ("model", "dtype", "storage", "kv_cache_dtype")
_TRANSFER_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def read_header(frame: Any, max_tokens: int) -> dict[str, Any]:
    """A payload's header frame as a dict of the keys a header has (its size bounded before it is parsed)."""
    size = memoryview(frame).nbytes
    if size > _MAX_HEADER_BYTES + _MAX_TOKEN_ID_CHARS * max_tokens:
        raise ValueError(f"a KV payload's header of {size} bytes is larger than any of {max_tokens} tokens")
    try:
        header = json.loads(bytes(frame))
    except (ValueError, RecursionError) as error:  # UnicodeDecodeError is a ValueError
        raise ValueError(f"a KV payload's header is not valid JSON: {error}") from None
    if not isinstance(header, dict) or not {"transfer_id", "layout", "token_ids"} <= set(header) <= _HEADER_KEYS:
        raise ValueError(f"a KV payload's header is not valid: it must hold {sorted(_HEADER_KEYS)} (sent_at optional)")
    return header


def check_transfer_id(value: object) -> str:
    """`value` if it is a transfer id (1 to 128 letters, digits and `._:-`); else ValueError."""
    if not isinstance(value, str) or not _TRANSFER_ID.fullmatch(value):
        raise ValueError("a transfer_id must be 1 to 128 letters, digits or '._:-'")
    return value


def _layout(value: object) -> KVLayout:
    """A KVLayout from a header's JSON, every field checked for its type and range."""
    fields = {field.name for field in dataclasses.fields(KVLayout)}
    if not isinstance(value, dict) or set(value) != fields:
        raise ValueError(f"a KV payload's layout must hold exactly the fields {sorted(fields)}")
    for name in _LAYOUT_SIZES:
        if type(value[name]) is not int or not 1 <= value[name] <= 1 << 16:
            raise ValueError(f"a KV payload's layout.{name} must be an integer in [1, 65536], got {value[name]!r}")
    for name in (*_LAYOUT_NAMES, "scales"):
        if not (isinstance(value[name], str) and len(value[name]) <= 64 or name == "scales" and value[name] is None):
            raise ValueError(f"a KV payload's layout.{name} must be a string of at most 64 characters")
    if value["storage"] not in _STORAGE:
        raise ValueError(f"a KV payload stored as {value['storage']!r}, which no pool holds")
    return KVLayout(**value)


def _raw(tensor: torch.Tensor) -> memoryview:
    """A CPU tensor's bytes, without a copy."""
    return memoryview(tensor.contiguous().view(torch.uint8).numpy())


def _tensor(frame: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A view of a received frame's bytes as a (shape) tensor, once its size is the one `shape` says."""
    data = memoryview(frame).cast("B")
    expected = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if data.nbytes != expected:
        raise ValueError(f"a KV payload's frame holds {data.nbytes} bytes; its header says {expected}")
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():  # a read-only frame: the tensor is only read (copied into the pool)
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(shape)


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
