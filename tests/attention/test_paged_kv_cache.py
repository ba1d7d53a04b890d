"""PagedKVCache and paged attention: the same numbers as the contiguous path, wherever the blocks lie."""

from __future__ import annotations

import pytest
import torch

from llm_runtime import SamplingParams, generate
from llm_runtime.attention import causal_attention, paged_attention, paged_decode_attention
from llm_runtime.core.block_manager import BlockManager
from llm_runtime.attention.kv_cache import PagedKVCache
from llm_runtime.attention.torch_gather import PagedKVBatch


@pytest.mark.parametrize("num_cached,num_new", [(0, 7), (10, 1), (9, 4)])
def test_paged_attention_equals_contiguous(num_cached: int, num_new: int) -> None:
    torch.manual_seed(0)
    block_size, num_keys = 4, num_cached + num_new
    keys = torch.randn(1, 2, num_keys, 8, dtype=torch.float64)  # (1, KV, S, d)
    values = torch.randn_like(keys)
    q = torch.randn(1, 6, num_new, 8, dtype=torch.float64)
    cache = PagedKVCache(1, 16, block_size, 2, 8, dtype=torch.float64, device="cpu")
    table = torch.randperm(16)[: -(-num_keys // block_size)]  # scattered, out of order
    slots = table[torch.arange(num_keys) // block_size] * block_size + torch.arange(num_keys) % block_size
    cache.write(0, slots, keys[0].transpose(0, 1), values[0].transpose(0, 1))
    paged = paged_attention(q, cache.keys[0], cache.values[0], table, num_cached)
    assert torch.equal(paged, causal_attention(q, keys, values, num_cached))


def test_copy_blocks_duplicates_every_layer() -> None:
    cache = PagedKVCache(2, 4, 2, 1, 3, dtype=torch.float32, device="cpu")
    for pool in cache.keys + cache.values:
        pool[1] = torch.randn(2, 1, 3)
    cache.copy_blocks([(1, 3)])
    assert all(torch.equal(pool[3], pool[1]) for pool in cache.keys + cache.values)


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_greedy_through_the_paged_pool_equals_generate(tiny_pairs, family: str) -> None:
    """Two sequences decode side by side through one pool, blocks from a BlockManager."""
    model, _ = tiny_pairs[family]
    prompts = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22]]
    num_steps = 12
    manager = BlockManager(num_blocks=32, block_size=4, enable_prefix_caching=False)
    cache = PagedKVCache.for_model(model.config, 32, 4, dtype=model.dtype, device="cpu")
    tokens = [list(p) for p in prompts]
    computed = [0, 0]
    for key, prompt in enumerate(prompts):
        manager.allocate(key, prompt)
    with torch.no_grad():
        for _ in range(num_steps):
            for key in (0, 1):
                manager.append_slots(key, len(tokens[key]))
            new = [tokens[k][computed[k]:] for k in (0, 1)]
            batch = PagedKVBatch(cache, [manager.block_tables[k] for k in (0, 1)], computed, [len(n) for n in new])
            positions = [p for k in (0, 1) for p in range(computed[k], len(tokens[k]))]
            hidden = model(torch.tensor([new[0] + new[1]]), batch, torch.tensor([positions]))
            ends = torch.tensor([len(new[0]) - 1, len(new[0]) + len(new[1]) - 1])
            next_tokens = model.compute_logits(hidden[0, ends]).argmax(-1).tolist()
            for k in (0, 1):
                computed[k] = len(tokens[k])
                tokens[k].append(next_tokens[k])
    for k, prompt in enumerate(prompts):
        expected = generate(model, prompt, SamplingParams(temperature=0, max_tokens=num_steps, ignore_eos=True))
        assert tokens[k][len(prompt):] == expected


def test_batched_decode_attention_equals_each_sequence_alone() -> None:
    """Three sequences of different lengths, scattered blocks, one padded call."""
    torch.manual_seed(1)
    block_size, lengths = 4, [9, 3, 14]
    cache = PagedKVCache(1, 16, block_size, 2, 8, dtype=torch.float64, device="cpu")
    order = torch.randperm(16).tolist()
    tables, expected, queries = [], [], []
    for length in lengths:
        table = [order.pop() for _ in range(-(-length // block_size))]
        keys = torch.randn(1, 2, length, 8, dtype=torch.float64)  # (1, KV, S, d)
        values = torch.randn_like(keys)
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(length)])
        cache.write(0, slots, keys[0].transpose(0, 1), values[0].transpose(0, 1))
        q = torch.randn(1, 6, 1, 8, dtype=torch.float64)
        expected.append(causal_attention(q, keys, values, length - 1))
        tables.append(table)
        queries.append(q)
    width = max(map(len, tables))
    padded = torch.tensor([t + [t[0]] * (width - len(t)) for t in tables])
    mask = (torch.arange(width * block_size) < torch.tensor(lengths)[:, None])[:, None, None, :]
    batched = paged_decode_attention(torch.cat(queries), cache.keys[0], cache.values[0], padded, mask)
    assert torch.allclose(batched, torch.cat(expected), atol=1e-12)
