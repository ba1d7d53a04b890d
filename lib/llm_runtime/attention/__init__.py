"""Attention over a key/value history: the caches that hold it and the code that reads it.

`causal.py` is attention over one contiguous history; `kv_cache.py` holds the caches (one
contiguous tensor per sequence, or the engine's paged pool); `torch_gather.py` is the reference
paged path, which gathers each sequence's blocks out of the pool before attending.
"""

from .causal import causal_attention
from .kv_cache import ContiguousKVCache, KVCache, PagedKVCache, kv_block_bytes, num_blocks_in
from .torch_gather import PagedKVBatch, paged_attention, paged_decode_attention

__all__ = [
    "ContiguousKVCache",
    "KVCache",
    "PagedKVBatch",
    "PagedKVCache",
    "causal_attention",
    "kv_block_bytes",
    "num_blocks_in",
    "paged_attention",
    "paged_decode_attention",
]
