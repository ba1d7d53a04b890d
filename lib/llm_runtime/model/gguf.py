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
it steps over the metadata by lengths alone and maps the bytes without copying them: 0.1 s where the `gguf`
package's reader, which decodes every string of the metadata into Python objects, took 5 s.
"""

from __future__ import annotations

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
    little-endian). Raises ValueError for anything else, a file cut short, or a tensor of a type `GGML_TYPES`
    does not hold."""
    try:
        return _read_gguf_tensors(path, names)
    except struct.error as error:  # a length or a count ran past the end of the file
        raise ValueError(f"{path} is cut short: {error}") from error


def _read_gguf_tensors(path: str | Path, names: set[str] | None) -> dict[str, GGUFTensor]:
    buffer = np.memmap(path, dtype=np.uint8, mode="r")
    view = memoryview(buffer)
    if bytes(view[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    version, num_tensors, num_fields = struct.unpack_from("<IQQ", view, 4)
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} (big-endian, or not 2 or 3) is not read here")
    position = 4 + struct.calcsize("<IQQ")

    def string() -> str:
        nonlocal position
        (length,) = struct.unpack_from("<Q", view, position)
        position += 8 + length
        return bytes(view[position - length : position]).decode("utf-8")

    def skip_value(kind: int) -> int | None:
        """Step over a value of type `kind`; an unsigned 32-bit one (the alignment) is returned."""
        nonlocal position
        if kind in _SCALAR_BYTES:
            value = struct.unpack_from("<I", view, position)[0] if kind == 4 else None
            position += _SCALAR_BYTES[kind]
            return value
        if kind == _STRING:
            position += 8 + struct.unpack_from("<Q", view, position)[0]
        elif kind == _ARRAY:
            item_kind, count = struct.unpack_from("<IQ", view, position)
            position += 12
            if item_kind in _SCALAR_BYTES:
                position += count * _SCALAR_BYTES[item_kind]
            else:  # strings (or nested arrays): one length at a time
                for _ in range(count):
                    skip_value(item_kind)
        else:
            raise ValueError(f"{path}: unknown metadata value type {kind}")
        return None

    alignment = 32
    for _ in range(num_fields):
        key = string()
        (kind,) = struct.unpack_from("<I", view, position)
        position += 4
        value = skip_value(kind)
        if key == "general.alignment" and value is not None:
            alignment = value
    directory = []
    for _ in range(num_tensors):
        name = string()
        (num_dims,) = struct.unpack_from("<I", view, position)
        dims = struct.unpack_from(f"<{num_dims}Q", view, position + 4)
        type_code, offset = struct.unpack_from("<IQ", view, position + 4 + 8 * num_dims)
        position += 4 + 8 * num_dims + 12
        directory.append((name, dims, type_code, offset))
    data_start = -(-position // alignment) * alignment
    tensors = {}
    for name, dims, type_code, offset in directory:
        if names is not None and name not in names:
            continue
        if type_code not in GGML_TYPES:
            raise ValueError(f"{path}: {name} has ggml type {type_code}, which is not read here")
        type_name, block, block_bytes = GGML_TYPES[type_code]
        columns, rows = dims[0], int(np.prod(dims[1:], dtype=np.int64))
        row_bytes = columns // block * block_bytes
        start, end = data_start + offset, data_start + offset + rows * row_bytes
        if end > len(buffer):
            raise ValueError(f"{path} is cut short: {name} ends at byte {end:,} of {len(buffer):,}")
        raw = buffer[start:end].reshape(rows, row_bytes)
        if type_name in ("F32", "F16"):
            raw = raw.view(np.float32 if type_name == "F32" else np.float16)
        shape = tuple(reversed(dims))
        tensors[name] = GGUFTensor(type_name, shape, raw.reshape(shape) if block == 1 else raw)
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


def gguf_linear_blocks(path: str | Path, config: ModelConfig) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Every Q4_1 linear weight of the file, by our module path: (q, d, m) with rows in Hugging Face order."""
    blocks = {}
    for name, tensor in read_gguf_tensors(path).items():
        parts = name.split(".")  # blk.{i}.{name}.weight
        if parts[0] != "blk" or parts[2] not in _LINEAR_NAMES:
            continue
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
