"""PrefixCache: keys from a random root, and hits checked on tokens and parents, never trusted on a key; eviction
leaves no entry behind that a lookup could never reach again."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_runtime.core import prefix_cache as prefix_cache_module
from llm_runtime.core.block_manager import BlockManager
from llm_runtime.core.prefix_cache import CachedBlock, PrefixCache


def test_keys_are_sha256_chains_from_a_random_root_per_cache() -> None:
    a, b = PrefixCache(), PrefixCache()
    assert a.root != b.root and len(a.root) == 32
    assert a.key(None, [1, 2, 3]) != b.key(None, [1, 2, 3])  # not predictable across caches
    assert a.key(None, [1, 2, 3]) == a.key(None, [1, 2, 3]) and len(a.key(None, [1, 2, 3])) == 32
    first = a.insert(0, None, [1, 2, 3])
    assert a.lookup(None, [1, 2, 3]) is first and a.lookup(first, [1, 2, 3]) is None


def test_a_colliding_hash_costs_a_miss_never_a_wrong_block(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefix_cache_module, "block_hash", lambda parent, token_ids: b"same key for everything")
    cache = PrefixCache()
    first = cache.insert(0, None, [1, 2])
    assert first is not None and cache.lookup(None, [1, 2]) is first
    assert cache.lookup(None, [9, 9]) is None  # same key, other tokens: a miss
    assert cache.insert(1, None, [9, 9]) is None  # and it cannot be named over the first
    assert cache.insert(2, first, [3, 4]) is None  # nor can a child whose key is taken by another block
    assert cache.match([1, 2, 3, 4], 2, 2) == [first]


def test_a_block_whose_parent_was_evicted_can_no_longer_be_matched() -> None:
    cache = PrefixCache()
    parent = cache.insert(0, None, [1, 2])
    child = cache.insert(1, parent, [3, 4])
    assert cache.match([1, 2, 3, 4], 2, 2) == [parent, child]
    cache.park(0)
    assert cache.evict() == 0  # block 0 now holds something else
    assert cache.match([1, 2, 3, 4], 2, 2) == []
    reborn = cache.insert(5, None, [1, 2])  # the same prefix computed again, in another block
    assert cache.match([1, 2, 3, 4], 2, 2) == [reborn]  # the orphaned child is not trusted after it


def _dead_entries(cache: PrefixCache) -> list[CachedBlock]:
    """Named entries no lookup can reach: their parent is no longer the entry named for its block."""
    return [entry for entry in cache.by_block.values()
            if entry.parent is not None and cache.by_block.get(entry.parent.block) is not entry.parent]


def test_a_parked_child_is_evicted_before_its_parent() -> None:
    cache = PrefixCache()
    parent = cache.insert(0, None, [1, 2])
    child = cache.insert(1, parent, [3, 4])
    cache.park(0)  # the parent let go first, so it is the least recently parked ...
    cache.park(1)
    assert cache.evict() == 1  # ... but evicting it would strand the child: the child goes first
    assert cache.match([1, 2, 3, 4], 2, 2) == [parent] and child not in cache.by_block.values()
    assert cache.evict() == 0 and len(cache) == 0 and cache.num_evictable == 0


def test_an_evicted_blocks_children_in_use_lose_their_names_so_the_prefix_can_be_named_again() -> None:
    cache = PrefixCache()
    parent = cache.insert(0, None, [1, 2])
    grandchild = cache.insert(2, cache.insert(1, parent, [3, 4]), [5, 6])  # blocks 1 and 2 still held
    cache.park(0)
    assert cache.evict() == 0
    assert not cache.is_cached(1) and not cache.is_cached(2) and len(cache) == 0  # freed unnamed, when let go
    assert cache.insert(3, grandchild, [7, 8]) is None  # nor is anything named after them
    reborn = cache.insert(5, None, [1, 2])  # the prefix computed again, in other blocks: all of it can be named
    child = cache.insert(6, reborn, [3, 4])
    assert child is not None and cache.insert(7, child, [5, 6]) is not None
    assert [entry.block for entry in cache.match([1, 2, 3, 4, 5, 6], 2, 3)] == [5, 6, 7]


def test_a_block_whose_parent_stood_in_for_its_copy_leaves_no_dead_entry() -> None:
    """First writer wins: b's block 0 equals a's, so a's entry stands for it, and b's block 1 is named after a's
    block 0, which b does not hold. Once a's blocks are evicted, b's block 1 must not stay named: nothing could
    hit it, and its key would keep the same prefix from being named when it is computed again."""
    manager = BlockManager(num_blocks=10, block_size=2)
    a, b = [1, 2, 3, 4, 5], [1, 2, 7, 8, 9]
    assert manager.allocate("a", a) == 0 and manager.allocate("b", b) == 0  # both before either is computed
    manager.mark_computed("a", a, len(a))
    manager.mark_computed("b", b, len(b))
    cache = manager.allocator.prefix_cache
    b_second = manager.block_tables["b"][1]
    assert cache.is_cached(b_second) and not cache.is_cached(manager.block_tables["b"][0])
    manager.free("a")
    manager.allocate("x", [100] * 13)  # every free block and both of a's cached ones
    manager.check_invariants()
    assert not cache.is_cached(b_second) and not _dead_entries(cache)
    manager.free("b")
    assert b_second in manager.allocator.free  # a plain free block, not a parked name
    manager.free("x")
    manager.allocate("c", b)  # b's prompt again: nothing cached, computed and named anew
    manager.mark_computed("c", b, len(b))
    manager.free("c")
    manager.check_invariants()
    assert manager.allocate("d", b) == 4  # both full blocks hit
    manager.check_invariants()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "race", "free"]), st.integers(0, 3), st.integers(0, 30),
                          st.integers(0, 30)), max_size=30), st.integers(6, 12))
def test_no_named_entry_outlives_its_parent(ops: list[tuple[str, int, int, int]], num_blocks: int) -> None:
    """Random prompts over a few first blocks, some allocated together before either is computed (a race: the
    first to be named stands for the other's equal block), freed in any order, with evictions: after every step
    the books balance and every named entry can be hit."""
    tails = [[3, 4, 5], [8, 9, 1], [3, 4, 6, 6]]
    manager = BlockManager(num_blocks, block_size=2)
    live: list[tuple[int, int]] = []
    for step, (name, first, a, b) in enumerate(ops):
        if name == "free":
            if live:
                manager.free(live.pop(a % len(live)))
        else:
            prompts = [[first, first, *tails[a % 3]]] + ([[first, first, *tails[b % 3]]] if name == "race" else [])
            allocated = []
            for i, prompt in enumerate(prompts):
                if manager.can_allocate(prompt):
                    manager.allocate((step, i), prompt)
                    allocated.append(((step, i), prompt))
            for key, prompt in allocated:  # computed after all were allocated
                manager.mark_computed(key, prompt, len(prompt))
            live += [key for key, _ in allocated]
        manager.check_invariants()
        assert not _dead_entries(manager.allocator.prefix_cache)
