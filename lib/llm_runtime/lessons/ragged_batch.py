"""Lesson helper: a ragged batch over one contiguous cache per sequence (lesson 05).

The engine keeps every sequence's keys and values in one paged pool (`attention.torch_gather.
PagedKVBatch`); lesson 05 first builds a ragged batch the simplest way, each sequence with its own
`ContiguousKVCache`, to show that the linear layers can run once over every sequence's tokens.
"""

from __future__ import annotations

import torch

from ..attention.kv_cache import ContiguousKVCache


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
