"""Lesson 07 exercises: addressing a paged pool, and copy-on-write, checked against the package's paged code.

- `slot_mapping(block_table, start, num_tokens, block_size)`: the flat pool slot of each new token,
  against `attention.torch_gather.PagedKVBatch.slot_mapping`.
- `block_to_copy(block_table, ref_counts, num_tokens, block_size)`: which shared block a sequence must
  copy before it writes its next token, against `BlockManager.append_slots`.
"""

from __future__ import annotations

import random

import torch

from ...attention.kv_cache import PagedKVCache
from ...attention.torch_gather import PagedKVBatch
from ...core.block_manager import BlockManager
from .check import Case, Verdict, run_cases, same_value


def package_slot_mapping(block_table: list[int], start: int, num_tokens: int, block_size: int) -> list[int]:
    """The slots the engine's PagedKVBatch writes this sequence's new keys and values to."""
    pool = PagedKVCache(1, max(block_table) + 1, block_size, 1, 1, dtype=torch.float32, device="cpu")
    return PagedKVBatch(pool, [block_table], [start], [num_tokens]).slot_mapping.tolist()


def check_slot_mapping(fn: object) -> Verdict:
    """`slot_mapping(block_table, start, num_tokens, block_size) -> list[int]`: a sequence whose blocks are
    `block_table` (in order; block b holds slots b x block_size ... b x block_size + block_size - 1 of
    the flat pool) computes its tokens start ... start + num_tokens - 1 this step. Return the flat slot
    each of those tokens' keys and values are written to, in order."""

    def cases() -> list[Case]:
        rng = random.Random(7)
        inputs = [([3, 0, 7], 0, 10, 4, "a prefill over three blocks"),
                  ([5, 2], 6, 1, 4, "a decode in the second block"),
                  ([9, 4, 1], 8, 1, 4, "a decode opening a new block"),
                  ([2, 6, 1, 5], 3, 4, 2, "a chunk from the middle")]
        for _ in range(40):
            block_size = rng.choice([1, 2, 4, 8, 16])
            start = rng.randint(0, 40)
            num_tokens = rng.choice([1, 1, rng.randint(1, 20)])
            table = rng.sample(range(64), -(-(start + num_tokens) // block_size) + rng.choice([0, 0, 1]))
            inputs.append((table, start, num_tokens, block_size, ""))
        return [Case({"block_table": table, "start": start, "num_tokens": count, "block_size": size},
                     package_slot_mapping(table, start, count, size), note)
                for table, start, count, size, note in inputs]

    return run_cases("slot_mapping", fn, cases, same_value, "llm_runtime.attention.torch_gather.PagedKVBatch")


def _fork_scenario(rng: random.Random) -> Case:
    """A parent prompt forked into n completions that then write a few tokens each, in a random order;
    the case is one more token for one of them, and the package's copy-on-write decision for it."""
    block_size = rng.choice([2, 3, 4])
    manager = BlockManager(24, block_size, enable_prefix_caching=False)
    prompt_len = rng.randint(1, 3 * block_size)
    manager.allocate("parent", [1] * prompt_len)
    num_tokens = {"parent": prompt_len}
    for child in range(rng.randint(1, 3)):
        manager.fork("parent", f"child{child}")
        num_tokens[f"child{child}"] = prompt_len
    for _ in range(rng.randint(0, 4)):  # some of them decode a token (copying a shared block when they must)
        name = rng.choice(sorted(num_tokens))
        num_tokens[name] += 1
        manager.append_slots(name, num_tokens[name])
    name = rng.choice(sorted(num_tokens))
    table, ref_counts = list(manager.block_tables[name]), list(manager.allocator.ref_counts)
    copies = manager.append_slots(name, num_tokens[name] + 1)
    return Case({"block_table": table, "ref_counts": ref_counts, "num_tokens": num_tokens[name] + 1,
                 "block_size": block_size}, copies[0][0] if copies else None)


def check_block_to_copy(fn: object) -> Verdict:
    """`block_to_copy(block_table, ref_counts, num_tokens, block_size) -> int | None`: a sequence with
    `block_table` writes its next token, the one that makes it `num_tokens` tokens long (position
    num_tokens - 1). `ref_counts[b]` is how many sequences hold block b. Return the block it must copy
    first (copy-on-write: the block the token goes into, if another sequence also holds it), or None
    when no copy is needed (the block is its own, or the token opens a new block)."""

    def cases() -> list[Case]:
        rng = random.Random(7)
        hand = []
        for prompt_len, block_size, note in [(5, 4, "a fork writes into the shared half-full block"),
                                             (4, 4, "a fork's next token opens a new block")]:
            manager = BlockManager(8, block_size, enable_prefix_caching=False)
            manager.allocate("parent", [1] * prompt_len)
            manager.fork("parent", "child")
            table, ref_counts = list(manager.block_tables["child"]), list(manager.allocator.ref_counts)
            copies = manager.append_slots("child", prompt_len + 1)
            hand.append(Case({"block_table": table, "ref_counts": ref_counts, "num_tokens": prompt_len + 1,
                              "block_size": block_size}, copies[0][0] if copies else None, note))
        return hand + [_fork_scenario(rng) for _ in range(60)]

    return run_cases("block_to_copy", fn, cases, same_value, "llm_runtime.BlockManager.append_slots")
