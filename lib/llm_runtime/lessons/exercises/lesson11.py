"""Lesson 11 exercises: the online softmax, checked against the package's attention backends.

- `merge_attention(out1, lse1, out2, lse2)`: attention over two disjoint sets of keys, from each
  set's output and log-sum-exp, against `attention.blockwise.merge_partials`.
- `paged_decode(query, key_pool, value_pool, block_table, seq_len)`: one decoding token's attention
  over its sequence's blocks, read block by block with an online softmax, against the `torch-gather`
  reference backend (which gathers the whole history first).

Cases are float64, so an exact algorithm agrees with the package to rounding.
"""

from __future__ import annotations

import math

import torch

from ...attention.blockwise import attention_with_lse, merge_partials
from ...attention.metadata import AttentionMetadata
from ...attention.torch_gather import TorchGatherBackend
from .check import Case, Verdict, close_tensors, method_verdict, run_cases
from .operators import largest_read, record_operators

_DTYPE = torch.float64


# ------------------------------------------------------------------------------------------ merging
def _partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q (H, L, d) over k, v (H, S, d) and its log-sum-exp: (H, L, d), (H, L); S = 0 gives
    zeros and -inf (an empty set of keys)."""
    if k.shape[1] == 0:
        return torch.zeros_like(q), torch.full(q.shape[:2], -math.inf, dtype=q.dtype)
    out, lse = attention_with_lse(q[None], k[None], v[None])
    return out[0], lse[0].to(q.dtype)


def check_merge_attention(fn: object) -> Verdict:
    """`merge_attention(out1, lse1, out2, lse2) -> out`: out1 (num_heads, num_queries, head_dim) is softmax
    attention over one set of keys, lse1 (num_heads, num_queries) the log-sum-exp of those scores,
    log(sum_j exp(score_j)); out2, lse2 the same over a second, disjoint set of keys. Return attention
    over both sets together, (num_heads, num_queries, head_dim). A set may be empty (its lse is -inf
    and its out holds zeros), and scores may be large (an lse in the thousands)."""

    def cases() -> list[Case]:
        gen = torch.Generator().manual_seed(11)
        shapes = [(1, 1, 4, 3, 5, 1.0, "one query, a few keys each"),
                  (2, 3, 8, 6, 0, 1.0, "the second set is empty"),
                  (2, 3, 8, 0, 7, 1.0, "the first set is empty"),
                  (3, 2, 16, 20, 20, 300.0, "large scores: exp(lse) overflows even float64"),
                  (2, 4, 8, 1, 30, 3.0, "one key against thirty")]
        for _ in range(20):
            scale = [1.0, 1.0, 5.0, 100.0][int(torch.randint(4, (), generator=gen))]
            size = lambda low, high: int(torch.randint(low, high, (), generator=gen))  # noqa: E731
            shapes.append((size(1, 5), size(1, 5), size(2, 17), size(1, 40), size(1, 40), scale, ""))
        out = []
        for num_heads, num_queries, head_dim, first, second, scale, note in shapes:
            q = torch.randn(num_heads, num_queries, head_dim, generator=gen, dtype=_DTYPE) * scale
            k = torch.randn(num_heads, first + second, head_dim, generator=gen, dtype=_DTYPE)
            v = torch.randn(num_heads, first + second, head_dim, generator=gen, dtype=_DTYPE)
            out1, lse1 = _partial(q, k[:, :first], v[:, :first])
            out2, lse2 = _partial(q, k[:, first:], v[:, first:])
            expected = merge_partials([out1, out2], [lse1, lse2])
            out.append(Case({"out1": out1, "lse1": lse1, "out2": out2, "lse2": lse2}, expected, note))
        return out

    return run_cases("merge_attention", fn, cases, close_tensors(rtol=1e-6, atol=1e-9),
                     "llm_runtime.attention.blockwise.merge_partials")


# ------------------------------------------------------------------------------------------ paged decode
def package_paged_decode(query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor,
                         block_table: list[int], seq_len: int) -> torch.Tensor:
    """The torch-gather backend's answer for one decoding token: (num_heads, head_dim)."""
    block_size = key_pool.shape[1]
    metadata = AttentionMetadata.build([block_table], [seq_len - 1], [1], block_size=block_size, device="cpu")
    slot = block_table[(seq_len - 1) // block_size], (seq_len - 1) % block_size
    key, value = key_pool[slot][None], value_pool[slot][None]  # (1, KV, d): this step's own key, already stored
    backend = TorchGatherBackend()
    return backend.forward(query[None], key, value, key_pool, value_pool, backend.plan(metadata))[0]


def check_paged_decode(fn: object) -> Verdict:
    """`paged_decode(query, key_pool, value_pool, block_table, seq_len) -> out`: one decoding token of a
    sequence with `seq_len` keys, its own included. The keys and values are in key_pool, value_pool
    (num_blocks, block_size, num_kv_heads, head_dim): key position p is in block block_table[p //
    block_size], slot p % block_size (the table may list more blocks than the sequence fills, and
    every slot past seq_len holds someone else's data). query is (num_heads, head_dim); query head h
    reads KV head h // (num_heads // num_kv_heads); the softmax scale is head_dim ** -0.5. Return the
    attention output, (num_heads, head_dim), reading one block at a time with an online softmax."""

    def cases() -> list[Case]:
        gen = torch.Generator().manual_seed(11)
        hand = [(4, 4, 8, 4, 1, 0, 1.0, "seq_len 1: the token sees only its own key"),
                (4, 2, 8, 4, 10, 0, 1.0, "a partly filled last block"),
                (6, 2, 8, 4, 8, 2, 1.0, "the table lists two blocks more than the sequence fills"),
                (9, 3, 16, 16, 40, 0, 1.0, "the bundled model's heads: 9 query heads over 3 KV heads"),
                (4, 1, 8, 2, 21, 0, 6.0, "large scores: the running max changes from block to block")]
        for _ in range(25):
            num_kv_heads = [1, 2, 3][int(torch.randint(3, (), generator=gen))]
            group = [1, 2, 3, 4][int(torch.randint(4, (), generator=gen))]
            block_size = [1, 2, 4, 8, 16][int(torch.randint(5, (), generator=gen))]
            seq_len = int(torch.randint(1, 60, (), generator=gen))
            extra = int(torch.randint(0, 2, (), generator=gen))
            scale = [1.0, 1.0, 4.0][int(torch.randint(3, (), generator=gen))]
            hand.append((num_kv_heads * group, num_kv_heads, 8, block_size, seq_len, extra, scale, ""))
        out = []
        for num_heads, num_kv_heads, head_dim, block_size, seq_len, extra, scale, note in hand:
            num_blocks = -(-seq_len // block_size) + extra
            pool_blocks = num_blocks + 4
            table = torch.randperm(pool_blocks, generator=gen)[:num_blocks].tolist()  # out of order, scattered
            shape = (pool_blocks, block_size, num_kv_heads, head_dim)
            key_pool = torch.randn(shape, generator=gen, dtype=_DTYPE)
            value_pool = torch.randn(shape, generator=gen, dtype=_DTYPE)
            query = torch.randn(num_heads, head_dim, generator=gen, dtype=_DTYPE) * scale
            expected = package_paged_decode(query, key_pool, value_pool, table, seq_len)
            out.append(Case({"query": query, "key_pool": key_pool, "value_pool": value_pool, "block_table": table,
                             "seq_len": seq_len}, expected, note))
        return out

    return run_cases("paged_decode", fn, cases, close_tensors(rtol=1e-6, atol=1e-9),
                     "llm_runtime.attention.torch_gather.TorchGatherBackend", method=_read_block_by_block)


def _read_block_by_block(fn: object) -> Verdict | None:
    """Fails an answer that copies more out of the pools at once than one block for every query head (a
    whole-history gather, which the task forbids); None when it reads block by block."""
    gen = torch.Generator().manual_seed(111)
    num_heads, num_kv_heads, head_dim, block_size, seq_len = 4, 2, 8, 2, 40  # 20 blocks, scattered
    table = torch.randperm(30, generator=gen)[:20].tolist()
    key_pool, value_pool = (torch.randn(30, block_size, num_kv_heads, head_dim, generator=gen, dtype=_DTYPE)
                            for _ in range(2))
    query = torch.randn(num_heads, head_dim, generator=gen, dtype=_DTYPE)
    case = Case({"query": query, "key_pool": key_pool, "value_pool": value_pool, "block_table": table,
                 "seq_len": seq_len}, None, "20 blocks of 2 positions, 2 KV heads")
    args = [query.clone(), key_pool.clone(), value_pool.clone(), list(table), seq_len]
    _, calls = record_operators(fn, *args)
    one_block = block_size * num_heads * head_dim  # a block's keys (or values), repeated for every query head
    read = largest_read(calls, args[1:3])
    if read is None or read[1] <= one_block:
        return None
    return method_verdict("paged_decode", case, "It gives the right answer, but not block by block: one operator "
                          "made more values out of the pools at once than one block holds (a gather, or blocks "
                          "copied one by one and then joined).",
                          f"at most {one_block} elements made from the pools by one operator (one block of "
                          f"{block_size} positions, for each of {num_heads} query heads)",
                          f"`{read[0]}` wrote {read[1]} elements made from them at once")

