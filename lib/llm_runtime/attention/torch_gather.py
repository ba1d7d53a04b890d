"""The reference paged attention: gather each sequence's keys and values out of the pool, then SDPA.

`TorchGatherBackend` is the `torch-gather` attention backend: new keys and values go into the pool
through the slot mapping, and each segment of the ragged batch attends over its own sequence's
blocks, found through its block table. Prefill chunks attend one by one; decoding
sequences attend in a few batched calls, grouped by length. The gather copies every sequence's
whole history in every layer: the simple, checkable path the faster backends are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .backend import AttentionBackend, PagedAttentionStep
from .causal import causal_attention
from .kv_cache import PagedKVCache
from .metadata import AttentionMetadata


def paged_attention(
    q: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    block_table: torch.Tensor,
    num_cached: int,
) -> torch.Tensor:
    """Causal attention for one sequence whose keys and values live in scattered blocks of a pool.

    q (1, num_heads, T, head_dim) holds positions num_cached .. num_cached + T - 1; the pools are
    (num_blocks, block_size, num_kv_heads, head_dim) and `block_table` (num_table_blocks,) lists
    the sequence's blocks in order. The keys are gathered into a contiguous copy, then attended as usual.
    """
    num_keys = num_cached + q.shape[2]
    block_size = key_pool.shape[1]
    blocks = block_table[: -(-num_keys // block_size)]
    keys = key_pool[blocks].flatten(0, 1)[:num_keys]  # (S, KV, d): the gather
    values = value_pool[blocks].flatten(0, 1)[:num_keys]
    keys, values = keys.transpose(0, 1)[None], values.transpose(0, 1)[None]  # (1, KV, S, d)
    return causal_attention(q, keys, values, num_cached)


def paged_decode_attention(
    q: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    block_tables: torch.Tensor,
    key_mask: torch.Tensor,
) -> torch.Tensor:
    """Decode attention for B sequences at once, one new query each, through their block tables.

    q (B, num_heads, 1, head_dim); pools (num_blocks, block_size, num_kv_heads, head_dim);
    `block_tables` (B, max_blocks), padded with any valid block; `key_mask` (B, 1, 1, max_blocks *
    block_size), True where a slot holds one of the sequence's tokens (its past and the new one).
    One gather of whole blocks and one attention call for the whole batch, instead of one per sequence.
    """
    keys = key_pool[block_tables].flatten(1, 2).transpose(1, 2)  # (B, KV, max_blocks * block_size, d)
    values = value_pool[block_tables].flatten(1, 2).transpose(1, 2)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=key_mask, enable_gqa=True)  # (B, H, 1, d)


@dataclass(frozen=True)
class GatherPlan:
    """Per step: each prefill chunk's rows and table, and the decodes in groups of similar length."""

    prefills: list[tuple[int, int, torch.Tensor, int]]  # (first row, end row, block table, cached tokens)
    decode_groups: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # (rows, padded tables, key mask)


class TorchGatherBackend(AttentionBackend):
    """The reference: gather each sequence's history out of the pool, then SDPA with a mask.

    Decoding sequences (one new token) attend in a few batched calls, grouped by length, over padded
    tables; prefill chunks attend one by one. The plan (groups, padded tables, masks) is built once
    per step; the gather happens in every layer.
    """

    name = "torch-gather"

    def plan(self, metadata: AttentionMetadata) -> GatherPlan:
        device = metadata.block_tables.device
        size = metadata.block_size
        tables, starts = metadata.block_tables_host, metadata.context_lens_host
        offsets = metadata.query_start_loc.tolist()
        prefills = [(offsets[b], offsets[b + 1], torch.tensor(tables[b], device=device), starts[b])
                    for b, count in enumerate(metadata.query_lens_host) if count != 1]
        # Decoding sequences attend in groups of similar length, each padded to its longest
        # table: one group would pad every sequence to the longest of the whole step.
        decode_groups = []
        decodes = sorted(metadata.decode_rows, key=lambda b: len(tables[b]))
        while decodes:
            shortest = len(tables[decodes[0]])
            group = [b for b in decodes if len(tables[b]) <= 1.25 * shortest + 1]
            decodes = decodes[len(group):]
            width = len(tables[group[-1]])
            padded = [list(tables[b]) + [tables[b][0]] * (width - len(tables[b])) for b in group]
            lengths = torch.tensor([starts[b] + 1 for b in group], device=device)
            mask = (torch.arange(width * size, device=device) < lengths[:, None])[:, None, None, :]  # (G, 1, 1, S)
            rows = torch.tensor([offsets[b] for b in group], device=device)  # (G,) places in the flat batch
            decode_groups.append((rows, torch.tensor(padded, device=device), mask))
        return GatherPlan(prefills, decode_groups)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_pool: torch.Tensor,
                value_pool: torch.Tensor, plan: GatherPlan) -> torch.Tensor:
        q = query.transpose(0, 1)[None]  # (1, H, N, d)
        out = torch.empty_like(q)
        for begin, end, table, start in plan.prefills:
            out[:, :, begin:end] = paged_attention(q[:, :, begin:end], key_pool, value_pool, table, start)
        for rows, tables, mask in plan.decode_groups:
            q_decode = q[0, :, rows].transpose(0, 1)[:, :, None]  # (G, H, 1, d)
            decoded = paged_decode_attention(q_decode, key_pool, value_pool, tables, mask)
            out[0, :, rows] = decoded[:, :, 0].transpose(0, 1)  # (H, G, d)
        return out[0].transpose(0, 1)  # (N, H, d)


class PagedKVBatch(PagedAttentionStep):
    """The reference step of lesson 07: the torch-gather backend over the scheduler's view of a step
    (each sequence's block table, first new position and number of new tokens)."""

    def __init__(
        self, cache: PagedKVCache, block_tables: list[list[int]], starts: list[int], num_new_tokens: list[int]
    ) -> None:
        metadata = AttentionMetadata.build(block_tables, starts, num_new_tokens, block_size=cache.block_size,
                                           device=cache.keys[0].device)
        super().__init__(cache, TorchGatherBackend(), metadata)
        self.slot_mapping = metadata.slot_mapping  # (N,) flat slot of every new token
