"""Paged KV memory bookkeeping: which physical blocks hold which sequence's keys and values.

The KV pool is cut into `num_blocks` blocks of `block_size` token slots. A sequence owns a *block
table*, the list of its blocks in order; token t lives in slot t % block_size of block
table[t // block_size]. Blocks are reference counted so that sequences can share them: a fork
(parallel sampling) shares all of its parent's blocks, and prefix caching shares every full block
whose tokens, and the tokens before them, are the same. A shared block is copied before a sequence
writes into it (copy-on-write).

With prefix caching (`prefix_cache.py`), a full block is named by a key chained from its parent
block's key and its own tokens, so equal keys mean equal prefixes (and a hit is checked on the
tokens, not trusted on the key). A block whose last reference goes keeps its name and contents,
and can be revived by a later request, until it is evicted, least recently used first.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as TokenList
from typing import Hashable

from .prefix_cache import CachedBlock, PrefixCache


class BlockAllocator:
    """A free list, a reference count per block, and the prefix cache of freed blocks that keep a hash.

    Invariants: a block is in exactly one of `free` (ref 0, unnamed), the prefix cache's evictable
    list (ref 0, named, LRU order) or in use (ref > 0); `num_free_blocks` counts the first two.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free: deque[int] = deque(range(num_blocks))
        self.prefix_cache = PrefixCache()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free) + self.prefix_cache.num_evictable

    def allocate(self) -> int:
        """A block with reference count 1: a never-used one if any, else the least recently freed cached one."""
        if self.free:
            block = self.free.popleft()
        elif self.prefix_cache.num_evictable:
            block = self.prefix_cache.evict()
        else:
            raise RuntimeError("out of KV blocks: check num_free_blocks before allocating")
        self.ref_counts[block] = 1
        return block

    def reset_prefix_cache(self) -> int:
        """Forget every cached block no one holds (they become free, unnamed); the number freed."""
        freed = 0
        while self.prefix_cache.num_evictable:
            self.free.append(self.prefix_cache.evict())
            freed += 1
        return freed

    def incref(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            self.prefix_cache.revive(block)  # a cached block comes back into use
        self.ref_counts[block] += 1

    def decref(self, block: int) -> None:
        if self.ref_counts[block] <= 0:
            raise RuntimeError(f"block {block} freed more often than it was taken")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if self.prefix_cache.is_cached(block):
                self.prefix_cache.park(block)
            else:
                self.free.append(block)


class BlockManager:
    """Block tables per sequence on top of a BlockAllocator; `seq_key` is any hashable sequence id."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.allocator = BlockAllocator(num_blocks)
        self.block_tables: dict[Hashable, list[int]] = {}
        # Per sequence, the cache entry standing for each of its leading full, computed blocks (its
        # own or an equal one named first); None once a block could not be named (a key collision).
        self._chains: dict[Hashable, list[CachedBlock | None]] = {}
        # Blocks received from another server (`import_prefix`), held until `release_import`.
        self.imports: dict[Hashable, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.allocator.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def has_blocks(self, seq_key: Hashable) -> bool:
        return seq_key in self.block_tables

    def num_named_blocks(self, seq_key: Hashable) -> int:
        """How many of the sequence's leading full, computed blocks went through the prefix cache."""
        return len(self._chains[seq_key])

    def _prefix_hits(self, token_ids: TokenList[int], use_cache: bool = True) -> list[CachedBlock]:
        """Cached blocks for the leading full blocks; never the whole prompt (its last token must run)."""
        if not (self.enable_prefix_caching and use_cache):
            return []
        return self.allocator.prefix_cache.match(token_ids, self.block_size, (len(token_ids) - 1) // self.block_size)

    def num_cached_tokens(self, token_ids: TokenList[int], use_cache: bool = True) -> int:
        """How many leading tokens `allocate` would find in the prefix cache now."""
        return len(self._prefix_hits(token_ids, use_cache)) * self.block_size

    def can_allocate(self, token_ids: TokenList[int], use_cache: bool = True) -> bool:
        """Whether blocks for all of `token_ids` can be had now (cached prefix blocks reused)."""
        hits = self._prefix_hits(token_ids, use_cache)
        revived = sum(1 for hit in hits if self.allocator.ref_counts[hit.block] == 0)
        return self.blocks_needed(len(token_ids)) - len(hits) + revived <= self.num_free_blocks

    def allocate(self, seq_key: Hashable, token_ids: TokenList[int], use_cache: bool = True) -> int:
        """Give `seq_key` a block table for `token_ids`; returns how many leading tokens are cached.

        `use_cache=False` computes every token (a request that wants the logprobs of its whole prompt).
        """
        if seq_key in self.block_tables:
            raise ValueError(f"{seq_key!r} already has blocks")
        if not self.can_allocate(token_ids, use_cache):
            raise RuntimeError("not enough free KV blocks: call can_allocate first")
        hits = self._prefix_hits(token_ids, use_cache)
        for hit in hits:
            self.allocator.incref(hit.block)
        fresh = [self.allocator.allocate() for _ in range(self.blocks_needed(len(token_ids)) - len(hits))]
        self.block_tables[seq_key] = [hit.block for hit in hits] + fresh
        self._chains[seq_key] = list(hits)
        return len(hits) * self.block_size

    def mark_computed(self, seq_key: Hashable, token_ids: TokenList[int], num_computed: int) -> None:
        """After a step: name the blocks that became full and computed, so later requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        chain, table = self._chains[seq_key], self.block_tables[seq_key]
        cache = self.allocator.prefix_cache
        while (len(chain) + 1) * self.block_size <= num_computed:
            i = len(chain)
            if chain and chain[-1] is None:  # the chain broke at a collision: nothing after it is named
                chain.append(None)
                continue
            tokens = token_ids[i * self.block_size : (i + 1) * self.block_size]
            chain.append(cache.insert(table[i], chain[-1] if chain else None, tokens))

    def import_prefix(self, import_key: Hashable, token_ids: TokenList[int]) -> tuple[list[int], int]:
        """Blocks for `token_ids` (whole blocks, computed elsewhere: lesson 18's KV transfer), named in the prefix
        cache by those tokens and held under `import_key` until `release_import`, so a request whose prompt starts
        with them finds them cached. Returns the blocks in order and how many leading ones were cached already
        (those hold the same tokens' KV: only the rest are to be written)."""
        if not self.enable_prefix_caching:
            raise ValueError("received KV blocks go through the prefix cache: enable prefix caching")
        if len(token_ids) % self.block_size:
            raise ValueError(f"{len(token_ids)} tokens are not whole blocks of {self.block_size}")
        if import_key in self.imports or import_key in self.block_tables:
            raise ValueError(f"{import_key!r} already holds blocks")
        cached = self.allocate(import_key, token_ids) // self.block_size
        self.mark_computed(import_key, token_ids, len(token_ids))
        self.imports[import_key] = self.block_tables.pop(import_key)
        del self._chains[import_key]
        return list(self.imports[import_key]), cached

    def release_import(self, import_key: Hashable) -> None:
        """Let go of imported blocks: they stay in the prefix cache, evictable, like any finished prompt's."""
        for block in reversed(self.imports.pop(import_key)):
            self.allocator.decref(block)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block that no sequence holds; the number freed (blocks in use keep their names)."""
        return self.allocator.reset_prefix_cache()

    def can_append(self, seq_key: Hashable, num_tokens: int, num_new_tokens: int = 1) -> bool:
        """Whether the table can grow to hold `num_tokens`, and copy every shared block among those the last
        `num_new_tokens` of them are written to (1: a decode step)."""
        needed = self.blocks_needed(num_tokens) - len(self.block_tables[seq_key])
        return needed + len(self._shared_written(seq_key, num_tokens, num_new_tokens)) <= self.num_free_blocks

    def _shared_written(self, seq_key: Hashable, num_tokens: int, num_new_tokens: int) -> list[int]:
        """Indices into the table of the blocks that tokens [num_tokens - num_new_tokens, num_tokens) go to and
        that someone else also holds: a speculative step's 1 + k tokens may start in a block shared since a fork
        and end in a new one, so every block of the range is looked at, not only the last token's."""
        table = self.block_tables[seq_key]
        first = max(0, num_tokens - num_new_tokens) // self.block_size
        last = min((num_tokens - 1) // self.block_size, len(table) - 1)
        return [i for i in range(first, last + 1) if self.allocator.ref_counts[table[i]] > 1]

    def append_slots(self, seq_key: Hashable, num_tokens: int, num_new_tokens: int = 1) -> list[tuple[int, int]]:
        """Grow the table to hold `num_tokens`, of which the last `num_new_tokens` are written this step; returns
        the (source, destination) block copies to make first (copy-on-write of every shared block written)."""
        if not self.can_append(seq_key, num_tokens, num_new_tokens):
            raise RuntimeError("not enough free KV blocks: call can_append first")
        table = self.block_tables[seq_key]
        copies = []
        shared = self._shared_written(seq_key, num_tokens, num_new_tokens)
        for index in shared:  # copy-on-write: these tokens go into blocks someone else also reads
            source = table[index]
            table[index] = self.allocator.allocate()
            self.allocator.decref(source)
            copies.append((source, table[index]))
        if shared:
            del self._chains[seq_key][shared[0]:]
        while len(table) < self.blocks_needed(num_tokens):
            table.append(self.allocator.allocate())
        return copies

    def trim(self, seq_key: Hashable, num_tokens: int) -> None:
        """Free the blocks past the first `num_tokens` tokens' (slots of rejected speculative drafts): the last
        blocks of the table, never named, held by this sequence alone (it allocated them this step)."""
        table = self.block_tables[seq_key]
        keep = self.blocks_needed(num_tokens)
        if keep < len(self._chains[seq_key]):
            raise ValueError(f"cannot trim {seq_key!r} to {num_tokens} tokens: its blocks up to "
                             f"{len(self._chains[seq_key])} are computed")
        while len(table) > keep:
            self.allocator.decref(table.pop())

    def fork(self, parent_key: Hashable, child_key: Hashable) -> None:
        """The child shares every block of the parent (parallel sampling: one prompt, n completions)."""
        if child_key in self.block_tables:
            raise ValueError(f"{child_key!r} already has blocks")
        table = list(self.block_tables[parent_key])
        for block in table:
            self.allocator.incref(block)
        self.block_tables[child_key] = table
        self._chains[child_key] = list(self._chains[parent_key])

    def free(self, seq_key: Hashable) -> None:
        """Release a sequence's blocks, last first, so a prefix outlives its tails in the cache."""
        for block in reversed(self.block_tables.pop(seq_key)):
            self.allocator.decref(block)
        del self._chains[seq_key]

    def check_invariants(self) -> None:
        """Raise AssertionError unless the books balance: every reference is a table entry, and every
        block is exactly one of free, parked (named, evictable) or held."""
        allocator, cache = self.allocator, self.allocator.prefix_cache
        held: dict[int, int] = {}
        for table in (*self.block_tables.values(), *self.imports.values()):
            for block in table:
                held[block] = held.get(block, 0) + 1
        for block in range(allocator.num_blocks):
            assert allocator.ref_counts[block] == held.get(block, 0), f"block {block}: ref count != holders"
        free, parked = set(allocator.free), set(cache.evictable)
        assert len(free) == len(allocator.free) and not free & parked and not free & held.keys()
        assert not parked & held.keys(), "a parked block is held"
        assert len(free) + len(parked) + len(held) == allocator.num_blocks, "blocks lost or counted twice"
        assert all(block not in cache.by_block for block in free), "a free block is still named"
        assert all(block in cache.by_block for block in parked), "a parked block has no name"
        assert len(cache.by_key) == len(cache.by_block)
        for key, chain in self._chains.items():
            assert len(chain) <= len(self.block_tables[key])
