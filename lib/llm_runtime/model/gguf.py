"""The bundled GGUF's own 4-bit blocks, read byte by byte and run as 4-bit (`quantization="gguf"`).

The bundled SmolLM2 ships as llama.cpp's GGUF: every linear weight of the decoder in Q4_1, the embedding
(tied to the LM head) in Q8_0, the norms in float32. A row of a Q4_1 tensor is a run of 20-byte blocks,
one per 32 weights:

    bytes 0-1   d, float16      the scale
    bytes 2-3   m, float16      the minimum
    bytes 4-19  16 bytes        32 four-bit values q: byte j holds weight j (low nibble) and j + 16 (high)

and weight = d * q + m. That is an int4 group of 32 with scale d and zero m + 8 d in the form the int4
kernels read (`(q - 8) * scale + zero`, `quantized_linear.py`), so `Int4Linear` runs the file's own
values: nothing is rounded again when the scales are kept in float32 (in bfloat16 the scales round).
A Q8_0 block is 34 bytes: d (float16), then 32 int8 values, weight = d * q; the embedding stays so
(`load_gguf_embedding_`, `quantized_embedding.py`).

llama.cpp stores q and k with the rows of each head reordered for its rotary layout (pairs (i, i + d/2)
interleaved); transformers undoes that when it reads the file, and so does `hf_row_order` here.

The file itself (`read_gguf_tensors`): a header, the metadata (key, type, value: the model's shape, and the
tokenizer's 49,152 tokens and 48,900 merges as arrays of strings), a directory of tensors (name, shape, type,
offset), then the tensors' bytes, each at a multiple of the alignment. The tensors are all this module reads, so
it steps over the metadata by lengths alone and maps the bytes without copying them: 0.02 s where the `gguf`
package's reader, which decodes every string of the metadata into Python objects, takes 2.7 s.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from ..config import ModelConfig
from .quantized_embedding import Q8Embedding, Q8Head, Q8Table
from .quantized_linear import Int4Linear

BLOCK = 32  # weights per Q4_1 / Q8_0 block
Q4_1_BLOCK_BYTES = 20
Q8_0_BLOCK_BYTES = 34

# GGUF tensor name (in block i) -> the module path in our model, under model.layers.{i}
_LINEAR_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# ggml tensor types this module reads: name, weights per block, bytes per block.
GGML_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 3: ("Q4_1", BLOCK, Q4_1_BLOCK_BYTES),
              8: ("Q8_0", BLOCK, Q8_0_BLOCK_BYTES)}
# Metadata value types of fixed size (type code -> bytes); 8 is a string, 9 an array.
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


class GGUFTensor(NamedTuple):
    type_name: str  # "Q4_1", "Q8_0", "F32", "F16"
    shape: tuple[int, ...]  # as PyTorch writes it: (rows, columns); GGUF lists the dimensions innermost first
    data: np.ndarray  # (rows, bytes a row) uint8 for a block type, `shape` for a float one; read-only


def read_gguf_tensors(path: str | Path, names: set[str] | None = None) -> dict[str, GGUFTensor]:
    """The file's tensors (those in `names`, or all), mapped from the file, not copied (GGUF version 2 or 3,
    little-endian). Raises ValueError for anything else: a file cut short or malformed, or a tensor of a type
    `GGML_TYPES` does not hold."""
    buffer = np.memmap(path, dtype=np.uint8, mode="r")
    file = _Cursor(memoryview(buffer), str(path))
    try:
        return _read_tensors(file, buffer, names)
    except struct.error as error:  # a value ran past the end of the file
        raise ValueError(f"{path} is cut short: {error}") from error


class _Cursor:
    """Little-endian values read one after another from the file's bytes; never a step past its end."""

    def __init__(self, view: memoryview, path: str) -> None:
        self.view, self.path, self.position = view, path, 0

    def take(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self.view, self.position)  # struct.error past the end
        self.position += struct.calcsize(fmt)
        return values

    def skip(self, num_bytes: int) -> None:
        if num_bytes > len(self.view) - self.position:
            raise ValueError(f"{self.path} is cut short: {num_bytes:,} bytes wanted at byte {self.position:,} of "
                             f"{len(self.view):,}")
        self.position += num_bytes

    def string(self) -> str:
        (length,) = self.take("<Q")
        start = self.position
        self.skip(length)
        return bytes(self.view[start : self.position]).decode("utf-8", errors="replace")

    def skip_value(self, kind: int, depth: int = 0) -> int | None:
        """Step over a metadata value of type `kind`; an unsigned 32-bit one (the alignment) is returned."""
        if kind == 4:
            return self.take("<I")[0]
        if kind in _SCALAR_BYTES:
            self.skip(_SCALAR_BYTES[kind])
        elif kind == _STRING:
            self.skip(self.take("<Q")[0])
        elif kind == _ARRAY and depth < 4:
            item_kind, count = self.take("<IQ")
            if item_kind in _SCALAR_BYTES:
                self.skip(count * _SCALAR_BYTES[item_kind])
            else:  # strings (or arrays): one length at a time
                if count > (len(self.view) - self.position) // 8:  # each one takes 8 bytes at least
                    raise ValueError(f"{self.path} is cut short: an array of {count:,} at byte {self.position:,}")
                for _ in range(count):
                    self.skip_value(item_kind, depth + 1)
        else:
            raise ValueError(f"{self.path}: metadata value type {kind} (at depth {depth}) is not GGUF's")
        return None


def _read_tensors(file: _Cursor, buffer: np.memmap, names: set[str] | None) -> dict[str, GGUFTensor]:
    if bytes(file.view[:4]) != b"GGUF":
        raise ValueError(f"{file.path} is not a GGUF file")
    file.skip(4)
    version, num_tensors, num_fields = file.take("<IQQ")
    if version not in (2, 3):
        raise ValueError(f"{file.path}: GGUF version {version} (big-endian, or not 2 or 3) is not read here")
    alignment = 32
    for _ in range(num_fields):
        key = file.string()
        (kind,) = file.take("<I")
        value = file.skip_value(kind)
        if key == "general.alignment" and value is not None:
            if value <= 0 or value & (value - 1):
                raise ValueError(f"{file.path}: general.alignment {value} is not a power of two")
            alignment = value
    directory = []
    for _ in range(num_tensors):
        name = file.string()
        (num_dims,) = file.take("<I")
        if not 1 <= num_dims <= 4:
            raise ValueError(f"{file.path}: {name} has {num_dims} dimensions (GGUF allows 1 to 4)")
        dims = file.take(f"<{num_dims}Q")
        type_code, offset = file.take("<IQ")
        directory.append((name, dims, type_code, offset))
    data_start = -(-file.position // alignment) * alignment
    tensors = {}
    for name, dims, type_code, offset in directory:
        if names is not None and name not in names:
            continue
        if type_code not in GGML_TYPES:
            raise ValueError(f"{file.path}: {name} has ggml type {type_code}, which is not read here")
        type_name, block, block_bytes = GGML_TYPES[type_code]
        columns, rows = dims[0], math.prod(dims[1:])
        if columns % block:
            raise ValueError(f"{file.path}: {name}'s rows of {columns} are not whole {type_name} blocks of {block}")
        row_bytes = columns // block * block_bytes
        start, end = data_start + offset, data_start + offset + rows * row_bytes
        if end > len(buffer):
            raise ValueError(f"{file.path} is cut short: {name} ends at byte {end:,} of {len(buffer):,}")
        raw = buffer[start:end].reshape(rows, row_bytes)
        shape = tuple(reversed(dims))
        if block == 1:  # a float type: its values, in their shape
            raw = raw.view(np.float32 if type_name == "F32" else np.float16).reshape(shape)
        tensors[name] = GGUFTensor(type_name, shape, raw)
    return tensors


def q4_1_blocks(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of Q4_1 blocks (rows, num_blocks * 20) uint8 -> q (rows, num_blocks * 32) int32 in [0, 15],
    d and m (rows, num_blocks) float32: weight = d * q + m per block."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, Q4_1_BLOCK_BYTES)  # (rows, B, 20)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # (rows, B)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    packed = blocks[..., 4:]  # (rows, B, 16)
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1)  # (rows, B, 32): low nibbles first
    return (torch.from_numpy(q.reshape(rows, -1).astype(np.int32)), torch.from_numpy(d), torch.from_numpy(m))


def q8_0_blocks(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of Q8_0 blocks (rows, num_blocks * 34) uint8 -> q (rows, num_blocks * 32) int8, d (rows, num_blocks)
    float32: weight = d * q per block."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, Q8_0_BLOCK_BYTES)  # (rows, B, 34)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = blocks[..., 2:].copy().view(np.int8)  # (rows, B, 32)
    return torch.from_numpy(q.reshape(rows, -1)), torch.from_numpy(d)


def dequantize_q4_1(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    rows = q.shape[0]
    return (q.reshape(rows, -1, BLOCK).float() * d[..., None] + m[..., None]).reshape(rows, -1)


def hf_row_order(num_rows: int, num_heads: int) -> torch.Tensor:
    """Row i of the Hugging Face q (or k) weight is row order[i] of llama.cpp's (undoing its rotary permute)."""
    head_dim = num_rows // num_heads
    rows = torch.arange(num_rows).reshape(num_heads, head_dim // 2, 2)  # llama.cpp's (head, pair, half) order
    return rows.transpose(1, 2).reshape(num_rows)


def gguf_linear_blocks(path: str | Path,
                       config: ModelConfig) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Every Q4_1 linear weight of the file, by our module path: (q, d, m) with rows in Hugging Face order."""
    blocks = {}
    names = {f"blk.{i}.{part}.weight" for i in range(config.num_layers) for part in _LINEAR_NAMES}
    for name, tensor in read_gguf_tensors(path, names).items():
        parts = name.split(".")  # blk.{i}.{name}.weight
        if tensor.type_name != "Q4_1":
            raise ValueError(f"{name} is {tensor.type_name}; only Q4_1 linear weights load as int4")
        q, d, m = q4_1_blocks(tensor.data)
        if parts[2] in ("attn_q", "attn_k"):
            heads = config.num_heads if parts[2] == "attn_q" else config.num_kv_heads
            order = hf_row_order(q.shape[0], heads)
            q, d, m = q[order], d[order], m[order]
        blocks[f"model.layers.{parts[1]}.{_LINEAR_NAMES[parts[2]]}"] = (q, d, m)
    return blocks


def load_gguf_linears_(model: nn.Module, path: str | Path, *, dtype: torch.dtype) -> list[str]:
    """Replace, in place, the model's decoder linears by `Int4Linear`s holding the file's own Q4_1 blocks
    (q/k/v and gate/up fused, as `quantize_linears_` does), scales and zeros in `dtype`. Returns their names.
    The embedding and the LM head stay as the model has them."""
    blocks = gguf_linear_blocks(path, model.config)
    device = next(model.parameters()).device
    done = []
    for name, module in list(model.named_modules()):
        groups = dict(getattr(module, "FUSED_PROJECTIONS", {}))
        fused_parts = {part for parts in groups.values() for part in parts}
        groups.update({child: (child,) for child, sub in module.named_children()
                       if isinstance(sub, nn.Linear) and child not in fused_parts})
        for group, part_names in groups.items():
            keys = [f"{name}.{part}" for part in part_names]
            if not all(key in blocks for key in keys):
                continue
            q, d, m = (torch.cat([blocks[key][i] for key in keys]) for i in range(3))
            parts = [getattr(module, part) for part in part_names]
            bias = None if parts[0].bias is None else torch.cat([p.bias for p in parts])
            sizes = tuple(p.out_features for p in parts) if len(parts) > 1 else None
            layer = Int4Linear(q.to(device), d.to(device), (m + 8 * d).to(device), bias, dtype, sizes)
            for part in part_names:
                delattr(module, part)
            setattr(module, group, layer)
            done.append(f"{name}.{group}")
    return done


def load_gguf_embedding_(model: nn.Module, path: str | Path, *, dtype: torch.dtype) -> None:
    """Replace, in place, the model's embedding (and its tied LM head) by the file's Q8_0 table as stored
    (`quantized_embedding.py`): 8 bits a weight and a scale per 32, computing in `dtype`."""
    if not model.config.tie_word_embeddings:
        raise ValueError("the Q8_0 table replaces a tied embedding and head; this model's head is its own")
    tensor = read_gguf_tensors(path, {"token_embd.weight"}).get("token_embd.weight")
    if tensor is None or tensor.type_name != "Q8_0":
        found = "no token_embd.weight" if tensor is None else f"token_embd.weight in {tensor.type_name}"
        raise ValueError(f"the GGUF file has {found}; a Q8_0 embedding is needed")
    q, d = q8_0_blocks(tensor.data)
    device = next(model.parameters()).device
    table = Q8Table(q.to(device), d.to(device), dtype)
    model.model.embed_tokens = Q8Embedding(table)
    model.lm_head = Q8Head(table)
