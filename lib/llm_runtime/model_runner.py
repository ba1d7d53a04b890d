"""The model runner: one step's ragged batch in, one sampled token per finishing sequence out.

A ragged (varlen) batch has no padding. The tokens of every scheduled sequence are concatenated
into one row, `(1, N)` with N = total new tokens, each with its own position. The linear layers
(most of the compute) run once over all N tokens; attention splits them back per sequence, since
each sequence attends only to its own past. `RaggedKVBatch` keeps that past in one contiguous
cache per sequence (lesson 05); the engine's `PagedKVBatch` keeps it in the blocks of one shared
pool, found through each sequence's block table (lesson 07).

The runner owns the pool. On CUDA, `profile_kv_cache_memory` sizes it from what a forward pass
of the largest batch leaves free.
"""

from __future__ import annotations

import torch

from .attention import paged_attention, paged_decode_attention
from .config import EngineConfig
from .kv_cache import ContiguousKVCache, PagedKVCache
from .model import CausalLM
from .sampling import Sampler
from .scheduler import ScheduledBatch
from .sequence import sample_sequences


class RaggedKVBatch:
    """A KVCache over several sequences' caches: segment i of the flat batch belongs to cache i."""

    def __init__(self, caches: list[ContiguousKVCache], num_new_tokens: list[int]) -> None:
        self.caches = caches
        self.num_new_tokens = num_new_tokens

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (1, H, N, d), k, v (1, KV, N, d), N = sum of segments -> (1, H, N, d)."""
        segments = zip(self.caches, q.split(self.num_new_tokens, dim=2), k.split(self.num_new_tokens, dim=2),
                       v.split(self.num_new_tokens, dim=2))
        return torch.cat([cache.attend(layer_idx, qs, ks, vs) for cache, qs, ks, vs in segments], dim=2)

    def advance(self, num_new_tokens: int) -> None:
        for cache, count in zip(self.caches, self.num_new_tokens):
            cache.advance(count)


class PagedKVBatch:
    """A KVCache over a shared paged pool: new keys go through the slot mapping, each segment
    attends over its own sequence's blocks (the block tables come from the BlockManager).

    Decoding segments (one new token) attend together in one batched call over a padded table;
    prefill chunks attend one by one. Everything that does not change from layer to layer (slots,
    padded tables, masks) is built once per step, here.
    """

    def __init__(
        self, cache: PagedKVCache, block_tables: list[list[int]], starts: list[int], num_new_tokens: list[int]
    ) -> None:
        self.cache = cache
        self.starts = starts
        self.num_new_tokens = num_new_tokens
        device = cache.keys[0].device
        size = cache.block_size
        slots = [table[p // size] * size + p % size
                 for table, start, count in zip(block_tables, starts, num_new_tokens)
                 for p in range(start, start + count)]
        self.slot_mapping = torch.tensor(slots, device=device)  # (N,) flat slot of every new token
        offsets = [0]
        for count in num_new_tokens:
            offsets.append(offsets[-1] + count)
        self.decodes = [i for i, count in enumerate(num_new_tokens) if count == 1]
        self.prefills = [(offsets[i], offsets[i + 1], torch.tensor(block_tables[i], device=device), starts[i])
                         for i, count in enumerate(num_new_tokens) if count != 1]
        if self.decodes:
            width = max(len(block_tables[i]) for i in self.decodes)
            padded = [block_tables[i] + [block_tables[i][0]] * (width - len(block_tables[i])) for i in self.decodes]
            self.decode_tables = torch.tensor(padded, device=device)  # (B, width)
            lengths = torch.tensor([starts[i] + 1 for i in self.decodes], device=device)
            self.decode_mask = (torch.arange(width * size, device=device) < lengths[:, None])[:, None, None, :]
            self.decode_rows = torch.tensor([offsets[i] for i in self.decodes], device=device)  # (B,) in the flat batch

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (1, H, N, d), k, v (1, KV, N, d) -> (1, H, N, d)."""
        self.cache.write(layer_idx, self.slot_mapping, k[0].transpose(0, 1), v[0].transpose(0, 1))  # (N, KV, d)
        key_pool, value_pool = self.cache.keys[layer_idx], self.cache.values[layer_idx]
        if not self.prefills:  # a pure decode step: one call
            q_decode = q[0].transpose(0, 1)[:, :, None]  # (B, H, 1, d)
            out = paged_decode_attention(q_decode, key_pool, value_pool, self.decode_tables, self.decode_mask)
            return out[:, :, 0].transpose(0, 1)[None]  # (1, H, N, d)
        out = torch.empty_like(q)
        for begin, end, table, start in self.prefills:
            out[:, :, begin:end] = paged_attention(q[:, :, begin:end], key_pool, value_pool, table, start)
        if self.decodes:
            q_decode = q[0, :, self.decode_rows].transpose(0, 1)[:, :, None]  # (B, H, 1, d)
            decoded = paged_decode_attention(q_decode, key_pool, value_pool, self.decode_tables, self.decode_mask)
            out[0, :, self.decode_rows] = decoded[:, :, 0].transpose(0, 1)  # (H, B, d)
        return out

    def advance(self, num_new_tokens: int) -> None:
        """Nothing to do: the block manager, not the pool, knows how many tokens each sequence has."""


class ModelRunner:
    """Turns a ScheduledBatch into model inputs, runs the forward pass over the paged pool and samples."""

    def __init__(self, model: CausalLM, sampler: Sampler, kv_cache: PagedKVCache) -> None:
        self.model = model
        self.sampler = sampler
        self.kv_cache = kv_cache

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[list[int | None], list[dict[int, float] | None]]:
        """Returns, per scheduled sequence, its sampled token (None for a prefill chunk) and logprobs."""
        device = self.model.device
        self.kv_cache.copy_blocks(batch.block_copies)  # copy-on-write, before anyone writes this step
        token_ids: list[int] = []
        positions: list[int] = []
        for item in batch.items:
            token_ids += item.seq.token_ids(item.start, item.start + item.num_new_tokens)
            positions += range(item.start, item.start + item.num_new_tokens)
        counts = [item.num_new_tokens for item in batch.items]
        kv = PagedKVBatch(self.kv_cache, [item.block_table for item in batch.items],
                          [item.start for item in batch.items], counts)
        input_ids = torch.tensor([token_ids], device=device)  # (1, N)
        hidden = self.model(input_ids, kv, torch.tensor([positions], device=device))  # (1, N, hidden)

        # Only a sequence whose chunk reaches its last known token samples; take that position.
        sampling = [i for i, item in enumerate(batch.items) if item.samples]
        results: list[int | None] = [None] * len(batch.items)
        logprobs: list[dict[int, float] | None] = [None] * len(batch.items)
        if not sampling:
            return results, logprobs
        ends = torch.tensor(counts).cumsum(0) - 1  # index of each segment's last token
        last = ends[sampling].to(device)
        logits = self.model.compute_logits(hidden[0, last])  # (R, vocab)
        seqs = [batch.items[i].seq for i in sampling]
        out = sample_sequences(self.sampler, logits, seqs)
        sampled = out.token_ids.tolist()  # one host-device sync per step
        for row, i in enumerate(sampling):
            results[i] = sampled[row]
        if out.logprobs is not None:  # some row asked for logprobs: one more copy to the host
            sampled_logprobs = out.logprobs.tolist()
            top_ids = out.top_token_ids.tolist() if out.top_token_ids is not None else None
            top_logprobs = out.top_logprobs.tolist() if out.top_logprobs is not None else None
            for row, (i, seq) in enumerate(zip(sampling, seqs)):
                k = seq.params.logprobs
                if k is None:
                    continue
                entry = {sampled[row]: sampled_logprobs[row]}
                if top_ids is not None and top_logprobs is not None:
                    entry.update(zip(top_ids[row][:k], top_logprobs[row][:k]))
                logprobs[i] = entry
        return results, logprobs


@torch.inference_mode()
def profile_kv_cache_memory(model: CausalLM, config: EngineConfig) -> int:
    """CUDA: bytes left for the KV pool = total x gpu_memory_utilization - (weights + peak activations
    of a `max_num_batched_tokens` forward pass + memory held outside PyTorch)."""
    device = model.device
    if device.type != "cuda":
        raise ValueError(f"profiling measures CUDA memory; the model is on {device} (set num_kv_blocks "
                         f"or kv_cache_memory instead)")
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    num_tokens = min(config.max_num_batched_tokens, model.config.max_position_embeddings)
    input_ids = torch.zeros((1, num_tokens), dtype=torch.long, device=device)  # (1, T) dummy prompt
    hidden = model(input_ids)
    model.compute_logits(hidden[0, -config.max_num_seqs :])  # (max_num_seqs, vocab): the sampler's input
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    free, total = torch.cuda.mem_get_info(device)
    outside_torch = total - free - torch.cuda.memory_reserved(device)
    del hidden
    torch.cuda.empty_cache()
    available = int(total * config.gpu_memory_utilization) - peak - outside_torch
    if available <= 0:
        raise RuntimeError(
            f"no GPU memory left for the KV cache: weights and activations peak at {peak / 2**30:.2f} GiB "
            f"of {total / 2**30:.2f} GiB x gpu_memory_utilization {config.gpu_memory_utilization}; raise "
            f"gpu_memory_utilization or lower max_num_batched_tokens"
        )
    return available
