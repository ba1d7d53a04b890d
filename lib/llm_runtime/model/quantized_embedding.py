"""The bundled GGUF's Q8_0 embedding kept as 8 bits: one table for the token lookup and the tied LM head.

SmolLM2's embedding (49,152 x 576) is tied to its LM head, and the file stores it in Q8_0 blocks: per 32
columns of a row, a scale d and 32 int8 values, weight = d * q (`gguf.py`). In bfloat16 the table takes
56.6 MB, as much as all the 4-bit decoder layers; as stored it takes 30 MB. `Q8Table` keeps it so:

- the lookup (`Q8Embedding`) gathers the rows of the step's tokens and multiplies them by their scales;
- the head (`Q8Head`) is a product with the whole table. PyTorch's int8 kernel (`_weight_int8pack_mm`)
  takes one scale per output row, and Q8_0 has one per block of 32 columns: so the product is a sum of
  18 products, one per block of columns, each with that block's scales per row. At many rows the int8
  kernel is slower than bfloat16's matrix multiply, so the head turns the table back into bfloat16 a
  tile of rows at a time and multiplies those. On the CPU this package's C kernels do both
  (`quantized_kernels.py`): the few-row product in one pass over the table with its per-block scales
  (one row: 2.0 ms against 2.6 ms for the 18 products here, bfloat16), and the tiles (0.3 ms a tile of
  4,096 rows against 2.7 ms in PyTorch operations; at 256 rows the head took 43 ms, a dense bfloat16
  one 38 ms).
"""

from __future__ import annotations

import torch
from torch import nn

from ..native.operators import define_operator
from .quantized_kernels import kernels_unavailable_reason, q8_dequantize, q8_matmul

BLOCK = 32  # columns per Q8_0 block
SMALL_M = 4  # at most this many rows: the per-block int8 products; more: bfloat16 tiles
TILE_ROWS = 4096  # vocabulary rows turned back into the compute dtype at once


class Q8Table(nn.Module):
    """The Q8_0 table, block-major so each block of columns is one contiguous (vocab, 32) int8 matrix."""

    def __init__(self, q: torch.Tensor, d: torch.Tensor, dtype: torch.dtype, m: torch.Tensor | None = None) -> None:
        """q (vocab, hidden) int8, d (vocab, hidden / 32) float32: weight = d * q per block (+ m, a minimum per
        block shaped as d, for int8 in groups with a zero: quantized_linear.Int8GroupLinear)."""
        super().__init__()
        vocab, hidden = q.shape
        if hidden % BLOCK or d.shape != (vocab, hidden // BLOCK) or (m is not None and m.shape != d.shape):
            raise ValueError(f"a Q8_0 table of {tuple(q.shape)} needs scales (and minimums) of "
                             f"{(vocab, hidden // BLOCK)}, got {tuple(d.shape)}")
        self.vocab_size, self.hidden_size = vocab, hidden
        self.register_buffer("q", q.view(vocab, -1, BLOCK).transpose(0, 1).contiguous())  # (blocks, vocab, 32)
        self.register_buffer("d", d.t().contiguous().to(dtype))  # (blocks, vocab)
        self.register_buffer("m", None if m is None else m.t().contiguous().to(dtype))  # (blocks, vocab)

    @property
    def dtype(self) -> torch.dtype:
        return self.d.dtype

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` (...) of the table in the compute dtype: (..., hidden)."""
        return _dequantized_rows(self.q, self.d, self.m, index.reshape(-1)).reshape(*index.shape, self.hidden_size)

    def matmul_t(self, x: torch.Tensor) -> torch.Tensor:
        """x (M, hidden) @ table^T -> (M, vocab)."""
        product = q8_matmul_t if torch.compiler.is_compiling() else q8_product  # traced: one operator
        return product(x.to(self.dtype), self.q, self.d, self.m)


def q8_product(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, hidden) @ W^T -> (M, vocab) for a block-major Q8_0 table q (blocks, vocab, 32), d (blocks, vocab) in
    x's dtype (and its minimum m, shaped as d, if any), by the kernel that suits M (module docstring)."""
    vocab = q.shape[1]
    if x.device.type == "cpu" and kernels_unavailable_reason() is None:  # this package's C kernels
        if x.shape[0] <= SMALL_M:
            return q8_matmul(x.contiguous(), q, d, m)
        out = x.new_empty(x.shape[0], vocab)
        for start in range(0, vocab, TILE_ROWS):
            tile = q8_dequantize(q, d, start, min(start + TILE_ROWS, vocab), m)  # (tile, hidden)
            out[:, start : start + tile.shape[0]] = x @ tile.t()  # (M, tile)
        return out
    if x.shape[0] <= SMALL_M:
        out = None
        for block in range(q.shape[0]):  # sum over blocks of x_b @ (d_b * q_b + m_b)^T
            x_block = x[:, block * BLOCK : (block + 1) * BLOCK].contiguous()  # (M, 32)
            part = torch._weight_int8pack_mm(x_block, q[block], d[block])  # (M, vocab)
            if m is not None:
                part = part + x_block.sum(-1, keepdim=True) * m[block]  # every weight of the block + m
            out = part if out is None else out.add_(part)
        return out
    out = x.new_empty(x.shape[0], vocab)
    for start in range(0, vocab, TILE_ROWS):
        tile = _dequantized_rows(q, d, m, torch.arange(start, min(start + TILE_ROWS, vocab), device=x.device))
        out[:, start : start + tile.shape[0]] = x @ tile.t()  # (M, tile)
    return out


def _dequantized_rows(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, index: torch.Tensor) -> torch.Tensor:
    """Rows `index` (n,) of a block-major Q8_0 table (with its minimum m, if any) in d's dtype: (n, hidden)."""
    rows = q.permute(1, 0, 2)[index].to(d.dtype) * d.t()[index][..., None]  # (n, blocks, 32), contiguous
    if m is not None:
        rows = rows + m.t()[index][..., None]
    return rows.flatten(1)


# `q8_product` as one operator for torch.compile (worker/compiled_forward.py), as `int4_matmul` is.
q8_matmul_t = define_operator("q8_matmul_t", q8_product, dispatch_keys=("CPU", "CUDA"))


@torch.library.register_fake("llm_runtime::q8_matmul_t")
def _(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty(x.shape[0], q.shape[1])


class Q8Embedding(nn.Module):
    """Token ids (...) -> embeddings (..., hidden) from a `Q8Table`."""

    def __init__(self, table: Q8Table) -> None:
        super().__init__()
        self.table = table

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.table.rows(input_ids)

    def extra_repr(self) -> str:
        return f"{self.table.vocab_size}, {self.table.hidden_size}, Q8_0 (int8 in blocks of {BLOCK})"


class Q8Head(nn.Module):
    """Hidden states (..., hidden) -> logits (..., vocab) from the same `Q8Table` (a tied head)."""

    def __init__(self, table: Q8Table) -> None:
        super().__init__()
        self.table = table

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.table.matmul_t(hidden.reshape(-1, self.table.hidden_size))  # (M, vocab)
        return out.reshape(*hidden.shape[:-1], self.table.vocab_size)

    def extra_repr(self) -> str:
        return f"in_features={self.table.hidden_size}, out_features={self.table.vocab_size}, tied Q8_0 table"
