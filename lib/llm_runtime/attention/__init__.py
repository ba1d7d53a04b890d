"""Attention over a key/value history: the caches that hold it and the backends that read it.

`causal.py` is attention over one contiguous history; `kv_cache.py` holds the caches (one
contiguous tensor per sequence, or the engine's paged pool). The engine's paged attention goes
through a backend (`backend.py`), which reads one `AttentionMetadata` per step (`metadata.py`):
`torch_gather.py` is the reference, which gathers each sequence's blocks out of the pool before
attending; `blockwise.py` walks the block table with an online softmax; `cpu_backend.py` runs decodes
through this package's C kernel (`cpu_kernels.py`, `csrc/`) on the CPU; `triton_kernels.py` reads
blocks where they lie on a GPU; `selector.py` picks one by device and what is installed.
"""

from .backend import AttentionBackend, PagedAttentionStep
from .causal import causal_attention
from .kv_cache import ContiguousKVCache, KVCache, PagedKVCache, kv_block_bytes, num_blocks_in
from .metadata import AttentionMetadata
from .selector import available_backends, backend_class, select_backend
from .torch_gather import PagedKVBatch, TorchGatherBackend, paged_attention, paged_decode_attention

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "ContiguousKVCache",
    "KVCache",
    "PagedAttentionStep",
    "PagedKVBatch",
    "PagedKVCache",
    "TorchGatherBackend",
    "available_backends",
    "backend_class",
    "causal_attention",
    "kv_block_bytes",
    "num_blocks_in",
    "paged_attention",
    "paged_decode_attention",
    "select_backend",
]
