"""The reference paged attention: gather each sequence's keys and values out of the pool, then SDPA.

`PagedKVBatch` is what the engine's model runner hands the model for one step: new keys and values
go into the pool through the slot mapping, and each segment of the ragged batch attends over its
own sequence's blocks, found through its block table. Prefill chunks attend one by one; decoding
sequences attend in a few batched calls, grouped by length. The gather copies every sequence's
whole history in every layer: the simple, checkable path the faster backends are tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .causal import causal_attention
from .kv_cache import PagedKVCache


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


class PagedKVBatch:
    """A KVCache over a shared paged pool: new keys go through the slot mapping, each segment
    attends over its own sequence's blocks (the block tables come from the BlockManager).

    Decoding segments (one new token) attend in a few batched calls, grouped by length, over padded
    tables; prefill chunks attend one by one. Everything that does not change from layer to layer (slots,
    padded tables, masks) is built once per step, here.
    """

    def __init__(
        self, cache: PagedKVCache, block_tables: list[list[int]], starts: list[int], num_new_tokens: list[int]
    ) -> None:
        self.cache = cache
        device = cache.keys[0].device
        size = cache.block_size
        slots = [table[p // size] * size + p % size
                 for table, start, count in zip(block_tables, starts, num_new_tokens)
                 for p in range(start, start + count)]
        self.slot_mapping = torch.tensor(slots, device=device)  # (N,) flat slot of every new token
        offsets = [0]
        for count in num_new_tokens:
            offsets.append(offsets[-1] + count)
        self.prefills = [(offsets[i], offsets[i + 1], torch.tensor(block_tables[i], device=device), starts[i])
                         for i, count in enumerate(num_new_tokens) if count != 1]
        # Decoding sequences attend in groups of similar length, each padded to its longest
        # table: one group would pad every sequence to the longest of the whole step.
        self.decode_groups = []
        decodes = [i for i, count in enumerate(num_new_tokens) if count == 1]
        decodes.sort(key=lambda i: len(block_tables[i]))
        while decodes:
            shortest = len(block_tables[decodes[0]])
            group = [i for i in decodes if len(block_tables[i]) <= 1.25 * shortest + 1]
            decodes = decodes[len(group):]
            width = len(block_tables[group[-1]])
            padded = [block_tables[i] + [block_tables[i][0]] * (width - len(block_tables[i])) for i in group]
            lengths = torch.tensor([starts[i] + 1 for i in group], device=device)
            mask = (torch.arange(width * size, device=device) < lengths[:, None])[:, None, None, :]  # (G, 1, 1, S)
            rows = torch.tensor([offsets[i] for i in group], device=device)  # (G,) places in the flat batch
            self.decode_groups.append((rows, torch.tensor(padded, device=device), mask))

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (1, H, N, d), k, v (1, KV, N, d) -> (1, H, N, d)."""
        self.cache.write(layer_idx, self.slot_mapping, k[0].transpose(0, 1), v[0].transpose(0, 1))  # (N, KV, d)
        key_pool, value_pool = self.cache.keys[layer_idx], self.cache.values[layer_idx]
        out = torch.empty_like(q)
        for begin, end, table, start in self.prefills:
            out[:, :, begin:end] = paged_attention(q[:, :, begin:end], key_pool, value_pool, table, start)
        for rows, tables, mask in self.decode_groups:
            q_decode = q[0, :, rows].transpose(0, 1)[:, :, None]  # (G, H, 1, d)
            decoded = paged_decode_attention(q_decode, key_pool, value_pool, tables, mask)
            out[0, :, rows] = decoded[:, :, 0].transpose(0, 1)  # (H, G, d)
        return out

    def advance(self, num_new_tokens: int) -> None:
        """Nothing to do: the block manager, not the pool, knows how many tokens each sequence has."""
