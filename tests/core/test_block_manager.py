"""BlockManager under random operations (hypothesis): every invariant checked after every step.

A simulated physical pool records which token each slot holds, so prefix reuse and copy-on-write
are checked on contents, not just on counts.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_runtime.core.block_manager import BlockManager

BLOCK_SIZE = 4
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 7, 7], [5] * 12, []]


class Simulation:
    def __init__(self, num_blocks: int, prefix_caching: bool) -> None:
        self.manager = BlockManager(num_blocks, BLOCK_SIZE, prefix_caching)
        self.tokens: dict[int, list[int]] = {}
        self.pool: dict[int, list[int | None]] = {b: [None] * BLOCK_SIZE for b in range(num_blocks)}
        # What each physical block was computed after: the sequence's tokens up to the block's end.
        self.prefix_of_block: dict[int, tuple[int, ...]] = {}
        self.next_key = 0

    def write(self, key: int, start: int) -> None:
        """'Compute' tokens [start, len) of a sequence: write them into its blocks' slots."""
        table, tokens = self.manager.block_tables[key], self.tokens[key]
        for t in range(start, len(tokens)):
            self.pool[table[t // BLOCK_SIZE]][t % BLOCK_SIZE] = tokens[t]
            self.prefix_of_block[table[t // BLOCK_SIZE]] = tuple(tokens[: (t // BLOCK_SIZE + 1) * BLOCK_SIZE])
        self.manager.mark_computed(key, tokens, len(tokens))

    def add(self, tokens: list[int]) -> None:
        if not tokens or not self.manager.can_allocate(tokens):
            return
        key, self.next_key = self.next_key, self.next_key + 1
        cached = self.manager.allocate(key, tokens)
        table = self.manager.block_tables[key]
        assert cached % BLOCK_SIZE == 0 and cached < len(tokens)
        # Reused blocks really hold this prompt's tokens.
        assert [self.pool[table[t // BLOCK_SIZE]][t % BLOCK_SIZE] for t in range(cached)] == tokens[:cached]
        self.tokens[key] = list(tokens)
        self.write(key, cached)

    def append(self, key: int, token: int) -> None:
        tokens = self.tokens[key]
        if not self.manager.can_append(key, len(tokens) + 1):
            return self.preempt(key)
        tokens.append(token)
        for source, destination in self.manager.append_slots(key, len(tokens)):
            self.pool[destination] = list(self.pool[source])  # copy-on-write
        self.write(key, len(tokens) - 1)

    def fork(self, key: int) -> None:
        child, self.next_key = self.next_key, self.next_key + 1
        self.manager.fork(key, child)
        self.tokens[child] = list(self.tokens[key])

    def free(self, key: int) -> None:
        self.manager.free(key)
        del self.tokens[key]

    def preempt(self, key: int) -> None:
        """Recompute preemption: drop the blocks; the sequence comes back later with all its tokens."""
        tokens = self.tokens[key]
        self.free(key)
        self.add(tokens)

    def check(self) -> None:
        manager, allocator = self.manager, self.manager.allocator
        held: dict[int, int] = {}
        for key, table in manager.block_tables.items():
            assert len(table) == manager.blocks_needed(len(self.tokens[key]))
            for block in table:
                held[block] = held.get(block, 0) + 1
        for block in range(allocator.num_blocks):
            assert allocator.ref_counts[block] == held.get(block, 0) >= 0
        assert allocator.num_free_blocks + len(held) == allocator.num_blocks
        cache = allocator.prefix_cache
        manager.check_invariants()
        for block, entry in cache.by_block.items():
            assert cache.by_key[entry.key] is entry and entry.block == block
            assert tuple(self.pool[block]) == entry.token_ids  # a named block holds its tokens
        for key in manager.block_tables:  # every block a lookup can reach was computed after exactly its prefix
            tokens = self.tokens[key]
            hits = cache.match(tokens, BLOCK_SIZE, len(tokens) // BLOCK_SIZE)
            for i, hit in enumerate(hits):
                assert self.prefix_of_block[hit.block] == tuple(tokens[: (i + 1) * BLOCK_SIZE])
        for key, table in manager.block_tables.items():  # every sequence reads its own tokens
            tokens = self.tokens[key]
            assert [self.pool[table[t // BLOCK_SIZE]][t % BLOCK_SIZE] for t in range(len(tokens))] == tokens


operations = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, len(PREFIXES) - 1), st.lists(st.integers(1, 9), max_size=9)),
        st.tuples(st.just("append"), st.integers(0, 50), st.integers(1, 9)),
        st.tuples(st.just("fork"), st.integers(0, 50), st.just(0)),
        st.tuples(st.just("free"), st.integers(0, 50), st.just(0)),
        st.tuples(st.just("preempt"), st.integers(0, 50), st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(operations, st.integers(4, 24), st.booleans())
def test_random_operations_keep_every_invariant(ops, num_blocks: int, prefix_caching: bool) -> None:
    sim = Simulation(num_blocks, prefix_caching)
    for name, a, b in ops:
        live = sorted(sim.tokens)
        if name == "add":
            sim.add(PREFIXES[a] + b)
        elif live:
            key = live[a % len(live)]
            if name == "append":
                sim.append(key, b)
            elif name == "fork":
                sim.fork(key)
            elif name == "free":
                sim.free(key)
            else:
                sim.preempt(key)
        sim.check()
    for key in sorted(sim.tokens):
        sim.free(key)
    sim.check()
    allocator = sim.manager.allocator
    assert allocator.num_free_blocks == num_blocks and not any(allocator.ref_counts)


def test_prefix_reuse_lru_eviction_and_copy_on_write() -> None:
    manager = BlockManager(num_blocks=6, block_size=4)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert manager.allocate("a", prompt) == 0
    manager.mark_computed("a", prompt, len(prompt))
    # Same first 8 tokens: two full blocks reused, the third allocated fresh.
    assert manager.allocate("b", prompt[:8] + [42]) == 8
    assert manager.block_tables["b"][:2] == manager.block_tables["a"][:2]
    assert manager.allocator.ref_counts[manager.block_tables["a"][0]] == 2
    # A whole-prompt hit still leaves the last token to compute.
    assert manager.allocate("c", prompt[:8]) == 4
    for key in ("a", "b", "c"):
        manager.free(key)
    assert manager.num_free_blocks == 6 and len(manager.allocator.prefix_cache.evictable) == 2
    # Cached blocks survive until the pool needs them, least recently used first.
    assert manager.allocate("d", prompt) == 8
    manager.free("d")
    for i in range(6):
        manager.allocate(f"x{i}", [100 + i])
    assert not manager.allocator.prefix_cache.by_block
    # Fork then write: the shared partial block is copied, full blocks stay shared.
    for i in range(6):
        manager.free(f"x{i}")
    manager.allocate("p", [1, 2, 3, 4, 5])
    manager.fork("p", "q")
    copies = manager.append_slots("q", 6)
    assert len(copies) == 1 and copies[0][0] == manager.block_tables["p"][1]
    assert manager.block_tables["q"][0] == manager.block_tables["p"][0]
    assert manager.block_tables["q"][1] != manager.block_tables["p"][1]


def test_reset_prefix_cache_forgets_the_parked_blocks_and_keeps_the_held_ones() -> None:
    manager = BlockManager(num_blocks=8, block_size=2)
    held, parked = [1, 2, 3, 4, 5], [7, 8, 9, 10, 11]
    for key, tokens in (("held", held), ("parked", parked)):
        manager.allocate(key, tokens)
        manager.mark_computed(key, tokens, len(tokens))
    manager.free("parked")
    assert manager.num_cached_tokens(parked) == 4 and len(manager.allocator.prefix_cache.evictable) == 2
    assert manager.reset_prefix_cache() == 2
    manager.check_invariants()
    assert manager.num_cached_tokens(parked) == 0 and not manager.allocator.prefix_cache.evictable
    assert manager.num_cached_tokens(held) == 4  # in use: still named, still shared
    assert manager.num_free_blocks == 8 - 3 and manager.reset_prefix_cache() == 0


def test_a_write_that_starts_in_a_shared_block_and_ends_in_a_new_one_copies_it() -> None:
    """Speculation after a fork: the step writes the last prompt token and 4 drafts, positions 4 .. 8, starting in
    the block the siblings share (positions 4 .. 7) and ending in a new one. The shared block is copied, and
    the room for the copy is counted by can_append (before, only the last token's block was looked at)."""
    manager = BlockManager(num_blocks=5, block_size=4)
    manager.allocate("p", [1, 2, 3, 4, 5])  # blocks for positions 0 .. 7, the second one partly filled
    manager.fork("p", "q")
    shared = manager.block_tables["p"][1]
    assert manager.can_append("q", 9, 5)
    copies = manager.append_slots("q", 9, 5)
    assert copies == [(shared, manager.block_tables["q"][1])] and manager.block_tables["q"][1] != shared
    assert manager.block_tables["q"][0] == manager.block_tables["p"][0]  # full and not written: still shared
    assert len(manager.block_tables["q"]) == 3 and manager.allocator.ref_counts[shared] == 1
    # One free block left: a second sibling's 5-token write would need a copy and a new block.
    manager.fork("p", "r")
    assert manager.num_free_blocks == 1 and not manager.can_append("r", 9, 5) and manager.can_append("r", 8, 4)
    manager.check_invariants()


def test_refusals() -> None:
    manager = BlockManager(num_blocks=2, block_size=4)
    assert not manager.can_allocate(list(range(9)))
    with pytest.raises(RuntimeError, match="can_allocate"):
        manager.allocate("big", list(range(9)))
    with pytest.raises(ValueError):
        BlockManager(num_blocks=0, block_size=4)
