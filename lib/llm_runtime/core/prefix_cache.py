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

The entries form that tree too (`CachedBlock.children`), and eviction keeps it whole: an entry is only
reachable through its parent, so it must not outlive it. Named and unused, a child of an evicted
entry would take a place in the LRU list that no lookup can ever hit, and its key would keep the same
prefix, computed again, from being named. So `evict` takes a parked descendant of the least recently
parked block before the block itself (leaves first, as the sequences' own tails are parked first),
and when a block does go, the descendants still in use lose their names (they return to the
allocator as plain free blocks when let go), and nothing is named after them.
"""

from __future__ import annotations

import hashlib
import secrets
from array import array
from collections import OrderedDict
from collections.abc import Sequence as TokenList
from dataclasses import dataclass, field


def block_hash(parent_key: bytes, token_ids: TokenList[int]) -> bytes:
    """The key of a full block: SHA-256 of its parent's key and its own tokens (as int64s)."""
    digest = hashlib.sha256(parent_key)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


@dataclass(eq=False)
class CachedBlock:
    """A full, computed block named in the cache: its key, its own tokens, and the cached block before it.

    Compared by identity: `parent is` the entry a lookup matched one block earlier, or None for block 0;
    `children` are the named entries whose parent this is, in the order they were named.
    """

    block: int
    key: bytes
    token_ids: tuple[int, ...]
    parent: "CachedBlock | None"
    children: dict["CachedBlock", None] = field(default_factory=dict, repr=False)


class PrefixCache:
    """The named blocks (key <-> block) and the LRU list of those no one holds.

    Invariants: `by_key` and `by_block` hold the same entries; every block in `evictable` is named;
    every named entry's parent is named (so a lookup from the root can reach every entry).
    The allocator tells the cache when a block's last holder lets go (`park`) and when a parked
    block is taken again (`revive`); `evict` hands back a parked block, name dropped: the least
    recently parked one, or one of its parked descendants first.
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
        different block (a hash collision), or when `parent` was evicted since (no lookup could reach
        this block): then nothing after this block can be named for its sequence.
        """
        if block in self.by_block:
            return self.by_block[block]
        if parent is not None and self.by_block.get(parent.block) is not parent:
            return None
        key = self.key(parent, token_ids)
        existing = self.by_key.get(key)
        if existing is not None:
            same = existing.parent is parent and existing.token_ids == tuple(token_ids)
            return existing if same else None
        entry = CachedBlock(block, key, tuple(token_ids), parent)
        self.by_key[key] = entry
        self.by_block[block] = entry
        if parent is not None:
            parent.children[entry] = None
        return entry

    def park(self, block: int) -> None:
        """The block's last holder let go; keep it, most recently used end."""
        self.evictable[block] = None

    def revive(self, block: int) -> None:
        """A parked block is in use again."""
        del self.evictable[block]

    def evict(self) -> int:
        """Forget a parked block and return it for reuse: the least recently parked one, unless blocks that
        continue it are parked too; then the deepest of those, which costs no other entry its place.

        When a block goes, the blocks after it that are still in use lose their names (module docstring).
        """
        oldest = self.by_block[next(iter(self.evictable))]
        entry = self._parked_leaf(oldest)
        del self.evictable[entry.block]
        self._forget(entry)
        return entry.block

    def _parked_leaf(self, entry: CachedBlock) -> CachedBlock:
        """A parked entry of the tree under the parked `entry` (itself included) with no parked entry under it."""
        while True:
            below = self._first_parked_below(entry)
            if below is None:
                return entry
            entry = below

    def _first_parked_below(self, entry: CachedBlock) -> CachedBlock | None:
        stack = list(reversed(entry.children))  # depth first, in the order they were named
        while stack:
            node = stack.pop()
            if node.block in self.evictable:
                return node
            stack.extend(reversed(node.children))
        return None

    def _forget(self, entry: CachedBlock) -> None:
        """Drop the names of `entry` and of every entry under it (in use: a parked one would have gone first)."""
        if entry.parent is not None:
            del entry.parent.children[entry]
        stack = [entry]
        while stack:
            node = stack.pop()
            del self.by_block[node.block]
            del self.by_key[node.key]
            stack.extend(node.children)
            node.children.clear()
