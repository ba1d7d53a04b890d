"""PrefixCache: keys from a random root, and hits checked on tokens and parents, never trusted on a key."""

from __future__ import annotations

import pytest

from llm_runtime.engine import prefix_cache as prefix_cache_module
from llm_runtime.engine.prefix_cache import PrefixCache


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
