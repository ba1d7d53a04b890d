"""Helpers for lesson 19 (decode at the limit): the bytes a batch-1 step must read (the package's, and llama.cpp's
from its GGUF file), how the native step splits an int4 product into work items, and how OpenMP's static schedule
hands them out.
"""

from __future__ import annotations

from pathlib import Path

from ..model import CausalLM
from ..model.gguf import read_gguf_tensors


def step_weight_bytes(model: CausalLM) -> int:
    """Bytes of weights one decode step reads whatever the batch: every decoder layer's parameters and buffers, the
    final norm and the head (a tied Q8_0 table is read whole by the head; the embedding reads one row a token)."""
    layers = sum(t.numel() * t.element_size() for layer in model.model.layers
                 for t in (*layer.parameters(), *layer.buffers()))
    head = sum(t.numel() * t.element_size() for t in (*model.lm_head.parameters(), *model.lm_head.buffers()))
    return layers + head + model.model.norm.weight.numel() * model.model.norm.weight.element_size()


def gguf_step_bytes(path: str | Path) -> int:
    """Bytes of weights a batch-1 decode step of llama.cpp reads from the GGUF file at `path`: every tensor's data,
    but the token embedding's only where the file has its own head (`output.weight`; the embedding then reads one
    row a token); without one the head is the embedding, read whole."""
    tensors = read_gguf_tensors(path)
    tied = "output.weight" not in tensors
    return sum(t.data.nbytes for name, t in tensors.items() if tied or name != "token_embd.weight")


def half_block_rows(item: int) -> list[int]:
    """The 32 output rows of work item `item` of an int4 product in the native step (and the int4 kernel): half of
    a block of 64 rows of PyTorch's CPU packing, whose byte j holds row j in its low nibble and row j + 32 in its
    high one: rows 64 b + 16 h .. + 15 and 64 b + 32 + 16 h .. + 15, for block b = item // 2 and half h = item % 2."""
    block, half = divmod(item, 2)
    first = 64 * block + 16 * half
    return [*range(first, first + 16), *range(first + 32, first + 48)]


def static_schedule(num_items: int, num_threads: int) -> list[range]:
    """The items each thread runs under `#pragma omp for schedule(static)` (libgomp): contiguous runs, the first
    `num_items % num_threads` threads one item more than the others."""
    if num_items < 0 or num_threads < 1:
        raise ValueError(f"need num_items >= 0 and num_threads >= 1, got {num_items} and {num_threads}")
    base, extra = divmod(num_items, num_threads)
    runs, start = [], 0
    for thread in range(num_threads):
        count = base + (thread < extra)
        runs.append(range(start, start + count))
        start += count
    return runs
