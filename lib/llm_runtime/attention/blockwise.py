"""Block-wise paged attention in plain PyTorch: the block table walked in tiles, merged by an online softmax.

The reference backend copies each sequence's whole history out of the pool in every layer, then
attends over the copy. This one never holds a sequence's history at once:

- A decoding sequence's keys are read tile by tile (`tile_tokens` keys of its blocks at a time, for
  a group of sequences of similar length), each tile into a reused workspace that stays in cache;
  each tile's attention also returns its log-sum-exp, and the tiles' partial outputs are merged
  with the online-softmax rule (flash-decoding's split over KV).
- A prefill chunk attends in two parts merged the same way: over its cached prefix (read from the
  pool in tiles, no mask: every new token sees every cached one) and over its own new keys, which
  are the layer's inputs, causally (no pool read at all).

Masks, groups and index tensors are built once per step in `plan`; every layer reuses them. On
the CPU each tile runs ATen's fused flash-attention kernel, which returns the log-sum-exp; elsewhere
a few matmuls do the same (`attention_with_lse`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .backend import AttentionBackend
from .metadata import AttentionMetadata


def attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None, is_causal: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention that also returns each row's log-sum-exp of scores, so partial results over
    disjoint key sets can be merged exactly (`merge_partials`).

    q (B, H, L, d); k, v (B, KV, S, d) with H a multiple of KV; `mask` additive, broadcastable to
    (B, H, L, S); `is_causal` aligns the L queries with the last L keys. Returns (B, H, L, d) and the
    log-sum-exp (B, H, L) in float32.
    """
    scale = q.shape[-1] ** -0.5
    if q.device.type == "cpu" and q.dtype != torch.float64:  # its log-sum-exp is float32 (float64 is for tests)
        # It sums in float32 in every dtype; in float16 (a played T4) its inner loops convert element by element,
        # 4x slower here than converting the operands once (a 128-query prefill: 2.6 ms against 0.64 ms).
        half = q.dtype == torch.float16
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            *(t.float() if half else t for t in (q, k, v)), 0.0, is_causal,
            attn_mask=mask.float() if half and mask is not None else mask, scale=scale)
        return out.to(q.dtype), lse.float()  # (B, H, L, d), (B, H, L)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (B, H, S, d)
    compute = torch.promote_types(q.dtype, torch.float32)  # half precision accumulates in float32
    scores = torch.matmul(q.to(compute), k.to(compute).transpose(-1, -2)) * scale  # (B, H, L, S)
    if mask is not None:
        scores = scores + mask
    if is_causal:
        num_queries, num_keys = scores.shape[-2:]
        above = torch.ones(num_queries, num_keys, dtype=torch.bool, device=q.device).triu(num_keys - num_queries + 1)
        scores = scores.masked_fill(above, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (B, H, L)
    out = torch.matmul(torch.exp(scores - lse[..., None]), v.to(compute))
    return out.to(q.dtype), lse


def merge_partials(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
    """The online-softmax merge: attention over the union of disjoint key sets from each set's output
    and log-sum-exp. outs (B, H, L, d), lses (B, H, L); a set with lse = -inf contributes nothing."""
    if len(outs) == 1:
        return outs[0]
    lse = torch.stack(lses)  # (P, B, H, L)
    total = torch.logsumexp(lse, dim=0)  # (B, H, L)
    weights = torch.exp(lse - total)[..., None]  # (P, B, H, L, 1): each part's share of the softmax mass
    merged = sum(w * o.to(w.dtype) for w, o in zip(weights, outs))
    return merged.to(outs[0].dtype)


@dataclass(frozen=True)
class Tile:
    """Keys [first, first + num_keys) of a group of sequences: the blocks to read and the mask."""

    blocks: torch.Tensor  # (G * num_blocks,) pool blocks, row-major: sequence by sequence
    num_blocks: int  # blocks per sequence in this tile
    mask: torch.Tensor | None  # (G, 1, 1, num_blocks * block_size) additive, None when every key is real
    empty_rows: torch.Tensor | None  # (G,) True where a sequence has no key in this tile


@dataclass(frozen=True)
class DecodeGroup:
    rows: torch.Tensor  # (G,) rows of the flat batch
    tiles: list[Tile]


@dataclass(frozen=True)
class PrefillChunk:
    begin: int  # rows begin .. end - 1 of the flat batch
    end: int
    prefix_tiles: list[tuple[torch.Tensor, int]]  # (blocks, keys used) per tile of the cached prefix


@dataclass(frozen=True)
class BlockwisePlan:
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillChunk]


class BlockwiseBackend(AttentionBackend):
    """Paged attention over tiles of the block table with an online-softmax merge (module docstring).

    `tile_tokens` bounds the keys per sequence read at once; `max_group_rows` the decoding sequences
    attended together (together they bound the workspace, reused by every layer and step).
    """

    name = "blockwise"

    def __init__(self, tile_tokens: int = 512, max_group_rows: int = 64) -> None:
        if tile_tokens < 1 or max_group_rows < 1:
            raise ValueError("tile_tokens and max_group_rows must be >= 1")
        self.tile_tokens = tile_tokens
        self.max_group_rows = max_group_rows
        self._workspace: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    # ---------------------------------------------------------------- per step
    def plan(self, metadata: AttentionMetadata) -> BlockwisePlan:
        return BlockwisePlan(self._plan_decode_groups(metadata), self._plan_prefills(metadata))

    def _plan_prefills(self, metadata: AttentionMetadata, min_rows: int = 2) -> list[PrefillChunk]:
        """Each prefill chunk's rows and the tiles of its cached prefix (chunks of at least `min_rows` rows)."""
        size = metadata.block_size
        device = metadata.block_tables.device
        tile_blocks = max(1, self.tile_tokens // size)
        tables, seq_lens = metadata.block_tables_host, metadata.seq_lens_host
        offsets = row_offsets(metadata)
        prefills = []
        for b, count in enumerate(metadata.query_lens_host):
            if count < max(min_rows, 2):
                continue
            cached = seq_lens[b] - count
            tiles = []
            for first in range(0, cached, tile_blocks * size):  # the prefix, whole tiles of keys
                used = min(tile_blocks * size, cached - first)
                blocks = tables[b][first // size : (first + used + size - 1) // size]
                tiles.append((torch.tensor(blocks, device=device), used))
            prefills.append(PrefillChunk(offsets[b], offsets[b + 1], tiles))
        return prefills

    def _plan_decode_groups(self, metadata: AttentionMetadata) -> list[DecodeGroup]:
        """Decodes sorted by length, in groups of similar length (little padding) and bounded size."""
        size = metadata.block_size
        device = metadata.block_tables.device
        tile_blocks = max(1, self.tile_tokens // size)
        tables, seq_lens = metadata.block_tables_host, metadata.seq_lens_host
        offsets = row_offsets(metadata)
        decode_groups = []
        decodes = sorted(metadata.decode_rows, key=lambda b: seq_lens[b])
        while decodes:
            shortest = seq_lens[decodes[0]]
            group = [b for b in decodes[: self.max_group_rows] if seq_lens[b] <= 1.25 * shortest + size]
            decodes = decodes[len(group):]
            lengths = torch.tensor([seq_lens[b] for b in group], device=device)  # (G,)
            width = -(-seq_lens[group[-1]] // size)  # blocks of the longest
            tiles = []
            for first_block in range(0, width, tile_blocks):
                count = min(tile_blocks, width - first_block)
                blocks = [tables[b][first_block + j] if first_block + j < len(tables[b]) else tables[b][0]
                          for b in group for j in range(count)]
                first_key = first_block * size
                keys = torch.arange(count * size, device=device) + first_key  # (S,) positions in this tile
                real = keys[None, :] < lengths[:, None]  # (G, S)
                empty = ~real[:, 0]
                mask = None
                if not bool(real.all()):
                    # A sequence with no key here sees key 0 anyway (a finite softmax); the merge drops it.
                    allowed = real | (empty[:, None] & (keys[None, :] == first_key))
                    mask = torch.zeros(allowed.shape, device=device).masked_fill(~allowed, float("-inf"))
                    mask = mask[:, None, None, :]  # (G, 1, 1, S)
                tiles.append(Tile(torch.tensor(blocks, device=device), count, mask,
                                  empty if bool(empty.any()) else None))
            rows = torch.tensor([offsets[b] for b in group], device=device)
            decode_groups.append(DecodeGroup(rows, tiles))
        return decode_groups

    # ---------------------------------------------------------------- per layer
    def _read(self, pool: torch.Tensor, blocks: torch.Tensor, slot: int) -> torch.Tensor:
        """Blocks (n,) of `pool` copied into the reused workspace -> (n, block_size, KV, d)."""
        block_numel = pool[0].numel()
        need = 2 * blocks.numel() * block_numel
        key = (pool.device, pool.dtype)
        workspace = self._workspace.get(key)
        if workspace is None or workspace.numel() < need:
            workspace = self._workspace[key] = torch.empty(need, dtype=pool.dtype, device=pool.device)
        half = blocks.numel() * block_numel
        out = workspace[slot * half : (slot + 1) * half].view(blocks.numel(), *pool.shape[1:])
        return torch.index_select(pool, 0, blocks, out=out)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_pool: torch.Tensor,
                value_pool: torch.Tensor, plan: BlockwisePlan) -> torch.Tensor:
        out = torch.empty_like(query)  # (N, H, d)
        self._attend_decode_groups(query, key_pool, value_pool, plan.decode_groups, out)
        self._attend_prefills(query, key, value, key_pool, value_pool, plan.prefills, out)
        return out

    def _attend_decode_groups(self, query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor,
                              decode_groups: list[DecodeGroup], out: torch.Tensor) -> None:
        """out[row] for every decode row: tile by tile, merged by log-sum-exp."""
        num_kv_heads, head_dim = key_pool.shape[2:]
        for group in decode_groups:
            q = query.index_select(0, group.rows)[:, :, None]  # (G, H, 1, d)
            num_rows = q.shape[0]
            outs, lses = [], []
            for tile in group.tiles:
                keys = self._read(key_pool, tile.blocks, 0).view(num_rows, -1, num_kv_heads, head_dim)
                values = self._read(value_pool, tile.blocks, 1).view(num_rows, -1, num_kv_heads, head_dim)
                mask = tile.mask if tile.mask is None or tile.mask.dtype == q.dtype else tile.mask.to(q.dtype)
                o, lse = attention_with_lse(q, keys.transpose(1, 2), values.transpose(1, 2), mask)
                if tile.empty_rows is not None:
                    lse = lse.masked_fill(tile.empty_rows[:, None, None], float("-inf"))
                outs.append(o)
                lses.append(lse)
            out.index_copy_(0, group.rows, merge_partials(outs, lses)[:, :, 0])  # (G, H, d)

    def _attend_prefills(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         key_pool: torch.Tensor, value_pool: torch.Tensor, prefills: list[PrefillChunk],
                         out: torch.Tensor) -> None:
        """out[begin:end] for every prefill chunk: its cached prefix in tiles, then its own keys causally."""
        num_kv_heads, head_dim = key_pool.shape[2:]
        for chunk in prefills:
            q = query[chunk.begin : chunk.end].transpose(0, 1)[None]  # (1, H, T, d)
            outs, lses = [], []  # first the cached prefix, tile by tile, then the chunk's own keys
            for blocks, used in chunk.prefix_tiles:
                keys = self._read(key_pool, blocks, 0).view(1, -1, num_kv_heads, head_dim)[:, :used]
                values = self._read(value_pool, blocks, 1).view(1, -1, num_kv_heads, head_dim)[:, :used]
                o, lse = attention_with_lse(q, keys.transpose(1, 2), values.transpose(1, 2))
                outs.append(o)
                lses.append(lse)
            # The chunk's own keys, causally: this layer's inputs, so no read from the pool at all.
            k_new = key[chunk.begin : chunk.end].transpose(0, 1)[None]  # (1, KV, T, d)
            v_new = value[chunk.begin : chunk.end].transpose(0, 1)[None]
            o, lse = attention_with_lse(q, k_new, v_new, is_causal=True)
            outs.append(o)
            lses.append(lse)
            out[chunk.begin : chunk.end] = merge_partials(outs, lses)[0].transpose(0, 1)  # (T, H, d)


def row_offsets(metadata: AttentionMetadata) -> list[int]:
    """Where each sequence's rows start in the flat batch (and, last, the batch size)."""
    offsets = [0]
    for count in metadata.query_lens_host:
        offsets.append(offsets[-1] + count)
    return offsets
