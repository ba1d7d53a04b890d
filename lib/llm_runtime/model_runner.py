"""The model runner: one step's ragged batch in, one sampled token per finishing sequence out.

A ragged (varlen) batch has no padding. The tokens of every scheduled sequence are concatenated
into one row, `(1, N)` with N = total new tokens, each with its own position. The linear layers
(most of the compute) run once over all N tokens; attention splits them back per sequence, since
each sequence attends only to its own past, kept in its own KV cache.
"""

from __future__ import annotations

import torch

from .attention import paged_attention
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
    attends over its own sequence's blocks (the block tables come from the BlockManager)."""

    def __init__(
        self, cache: PagedKVCache, block_tables: list[list[int]], starts: list[int], num_new_tokens: list[int]
    ) -> None:
        self.cache = cache
        self.starts = starts
        self.num_new_tokens = num_new_tokens
        device = cache.keys[0].device
        self.block_tables = [torch.tensor(table, device=device) for table in block_tables]
        size = cache.block_size
        slots = [table[p // size] * size + p % size
                 for table, start, count in zip(block_tables, starts, num_new_tokens)
                 for p in range(start, start + count)]
        self.slot_mapping = torch.tensor(slots, device=device)  # (N,) flat slot of every new token

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (1, H, N, d), k, v (1, KV, N, d) -> (1, H, N, d)."""
        self.cache.write(layer_idx, self.slot_mapping, k[0].transpose(0, 1), v[0].transpose(0, 1))  # (N, KV, d)
        key_pool, value_pool = self.cache.keys[layer_idx], self.cache.values[layer_idx]
        segments = zip(q.split(self.num_new_tokens, dim=2), self.block_tables, self.starts)
        return torch.cat([paged_attention(qs, key_pool, value_pool, table, start) for qs, table, start in segments],
                         dim=2)

    def advance(self, num_new_tokens: int) -> None:
        """Nothing to do: the block manager, not the pool, knows how many tokens each sequence has."""


class ModelRunner:
    """Turns a ScheduledBatch into model inputs, runs the forward pass and samples."""

    def __init__(self, model: CausalLM, sampler: Sampler) -> None:
        self.model = model
        self.sampler = sampler

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[list[int | None], list[dict[int, float] | None]]:
        """Returns, per scheduled sequence, its sampled token (None for a prefill chunk) and logprobs."""
        device = self.model.device
        token_ids: list[int] = []
        positions: list[int] = []
        for item in batch.items:
            seq = item.seq
            if seq.kv_cache is None:  # first step of this sequence: reserve its cache, full length
                seq.kv_cache = self.model.new_kv_cache(1, seq.num_prompt_tokens + seq.max_new_tokens)
            token_ids += seq.token_ids(item.start, item.start + item.num_new_tokens)
            positions += range(item.start, item.start + item.num_new_tokens)
        counts = [item.num_new_tokens for item in batch.items]
        kv = RaggedKVBatch([item.seq.kv_cache for item in batch.items], counts)  # type: ignore[misc]
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
