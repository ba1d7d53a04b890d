"""Prefix caching: name every full KV block by its contents, so a new request reuses blocks already computed.

A full block is named by a hash chained from its parent block's hash and its own tokens:

    h0 = hash(NO_PARENT, tokens[0:16])      h1 = hash(h0, tokens[16:32])      ...

so equal hashes mean equal *prefixes*, not just equal blocks: block 1 of two prompts is shared
only if block 0 was too. A block that no sequence holds any more keeps its hash and contents
here, in least-recently-used order, until the allocator needs it for something else (eviction).
SGLang keeps the same information as a radix tree of token sequences; lesson 08 compares them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as TokenList

NO_PARENT = 0


def block_hash(parent_hash: int, token_ids: TokenList[int]) -> int:
    """The name of a full block: its parent's hash and its own tokens (ints hash the same in every process)."""
    return hash((parent_hash, tuple(token_ids)))


def chained_hashes(token_ids: TokenList[int], block_size: int, num_blocks: int | None = None) -> list[int]:
    """The hashes of the leading full blocks of `token_ids` (at most `num_blocks` of them)."""
    count = len(token_ids) // block_size if num_blocks is None else num_blocks
    hashes, parent = [], NO_PARENT
    for i in range(count):
        parent = block_hash(parent, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes


class PrefixCache:
    """The two-way map hash <-> block of full computed blocks, and the LRU list of those no one holds.

    Invariants: `hash_of` and `block_of` are inverse maps; every block in `evictable` has a hash.
    The allocator tells the cache when a block's last holder lets go (`park`) and when a parked
    block is taken again (`revive`); `evict` hands back the least recently parked one, hash dropped.
    """

    def __init__(self) -> None:
        self.hash_of: dict[int, int] = {}  # block -> hash
        self.block_of: dict[int, int] = {}  # hash -> block
        self.evictable: OrderedDict[int, None] = OrderedDict()  # parked blocks, least recent first

    def __len__(self) -> int:
        return len(self.hash_of)

    @property
    def num_evictable(self) -> int:
        return len(self.evictable)

    def lookup(self, hash_value: int) -> int | None:
        return self.block_of.get(hash_value)

    def is_cached(self, block: int) -> bool:
        return block in self.hash_of

    def insert(self, block: int, hash_value: int) -> None:
        """Name a full, computed block. First writer wins: a second copy of a prefix stays unnamed."""
        if block in self.hash_of or hash_value in self.block_of:
            return
        self.hash_of[block] = hash_value
        self.block_of[hash_value] = block

    def park(self, block: int) -> None:
        """The block's last holder let go; keep it, most recently used end."""
        self.evictable[block] = None

    def revive(self, block: int) -> None:
        """A parked block is in use again."""
        del self.evictable[block]

    def evict(self) -> int:
        """Forget the least recently parked block and return it for reuse."""
        block, _ = self.evictable.popitem(last=False)
        del self.block_of[self.hash_of.pop(block)]
        return block
