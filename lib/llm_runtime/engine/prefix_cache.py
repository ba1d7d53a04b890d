"""Prefix caching: name every full KV block by its contents, so a new request reuses blocks already computed.

A full block is named by a key chained from its parent block's key and its own tokens:

    k0 = sha256(root, tokens[0:16])      k1 = sha256(k0, tokens[16:32])      ...

so equal keys mean equal *prefixes*, not just equal blocks: block 1 of two prompts is shared only
if block 0 was too. The root is random per cache, so keys cannot be predicted across processes.
A hash alone is not trusted: a hit also compares the block's tokens and checks that the cached
block continues exactly the cached block matched before it (`CachedBlock.parent`). So even a
deliberately colliding hash can only cost a miss, never hand one prompt another prompt's keys and
values (the class of bug vLLM fixed as a security advisory).

A block that no sequence holds any more keeps its name and contents here, in least-recently-used
order, until the allocator needs it for something else (eviction). SGLang keeps the same
information as a radix tree of token sequences; lesson 08 compares them.
"""

from __future__ import annotations

import hashlib
import secrets
from array import array
from collections import OrderedDict
from collections.abc import Sequence as TokenList
from dataclasses import dataclass


def block_hash(parent_key: bytes, token_ids: TokenList[int]) -> bytes:
    """The key of a full block: SHA-256 of its parent's key and its own tokens (as int64s)."""
    digest = hashlib.sha256(parent_key)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


@dataclass(eq=False)
class CachedBlock:
    """A full, computed block named in the cache: its key, its own tokens, and the cached block before it.

    Compared by identity: `parent is` the entry a lookup matched one block earlier, or None for block 0.
    """

    block: int
    key: bytes
    token_ids: tuple[int, ...]
    parent: "CachedBlock | None"


class PrefixCache:
    """The named blocks (key <-> block) and the LRU list of those no one holds.

    Invariants: `by_key` and `by_block` hold the same entries; every block in `evictable` is named.
    The allocator tells the cache when a block's last holder lets go (`park`) and when a parked
    block is taken again (`revive`); `evict` hands back the least recently parked one, name dropped.
    """

    def __init__(self, root: bytes | None = None) -> None:
        self.root = secrets.token_bytes(32) if root is None else root
        self.by_key: dict[bytes, CachedBlock] = {}
        self.by_block: dict[int, CachedBlock] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()  # parked blocks, least recent first

    def __len__(self) -> int:
        return len(self.by_block)

    @property
    def num_evictable(self) -> int:
        return len(self.evictable)

    def key(self, parent: CachedBlock | None, token_ids: TokenList[int]) -> bytes:
        return block_hash(self.root if parent is None else parent.key, token_ids)

    def lookup(self, parent: CachedBlock | None, token_ids: TokenList[int]) -> CachedBlock | None:
        """The cached block holding `token_ids` right after `parent`'s prefix; keys, tokens and parent all checked."""
        entry = self.by_key.get(self.key(parent, token_ids))
        if entry is None or entry.parent is not parent or entry.token_ids != tuple(token_ids):
            return None
        return entry

    def match(self, token_ids: TokenList[int], block_size: int, num_blocks: int) -> list[CachedBlock]:
        """The cached blocks for the leading full blocks of `token_ids` (at most `num_blocks`), in order."""
        hits: list[CachedBlock] = []
        for i in range(num_blocks):
            entry = self.lookup(hits[-1] if hits else None, token_ids[i * block_size : (i + 1) * block_size])
            if entry is None:
                break
            hits.append(entry)
        return hits

    def is_cached(self, block: int) -> bool:
        return block in self.by_block

    def insert(self, block: int, parent: CachedBlock | None, token_ids: TokenList[int]) -> CachedBlock | None:
        """Name a full, computed block that follows `parent`; returns the entry that stands for its contents.

        First writer wins: when an equal block (same parent, same tokens) is named already, that
        entry stands for this one too and this copy stays unnamed. None when the key is taken by a
        different block (a hash collision): then nothing after this block can be named for its sequence.
        """
        if block in self.by_block:
            return self.by_block[block]
        key = self.key(parent, token_ids)
        existing = self.by_key.get(key)
        if existing is not None:
            same = existing.parent is parent and existing.token_ids == tuple(token_ids)
            return existing if same else None
        entry = CachedBlock(block, key, tuple(token_ids), parent)
        self.by_key[key] = entry
        self.by_block[block] = entry
        return entry

    def park(self, block: int) -> None:
        """The block's last holder let go; keep it, most recently used end."""
        self.evictable[block] = None

    def revive(self, block: int) -> None:
        """A parked block is in use again."""
        del self.evictable[block]

    def evict(self) -> int:
        """Forget the least recently parked block and return it for reuse.

        Cached blocks that continue it stay named but can no longer be matched (their parent is
        gone from the cache), so they age out of the LRU list like any other.
        """
        block, _ = self.evictable.popitem(last=False)
        entry = self.by_block.pop(block)
        del self.by_key[entry.key]
        return block
