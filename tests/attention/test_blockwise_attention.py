"""The block-wise backend equals the torch-gather reference, and its two building blocks are exact.

Random pools with shuffled block tables (reading a wrong block shows), every kind of row in one
batch (prefill chunks from an empty cache, extends over a cached prefix, decodes at block edges),
GQA groups of 1, 3, 4 and 8, head dims 64 and 128, and tiles small enough that a sequence's keys
span several of them (the log-sum-exp merge) and decodes fall into several groups.
"""

from __future__ import annotations

import pytest
import torch

from llm_runtime.attention.blockwise import BlockwiseBackend, attention_with_lse, merge_partials
from llm_runtime.attention.metadata import AttentionMetadata
from llm_runtime.attention.torch_gather import TorchGatherBackend

BLOCK_SIZE = 16
GQA = [(2, 2), (6, 2), (4, 1), (8, 1)]  # (H, KV): 1, 3, 4 and 8 query heads per KV head
MIXED_CONTEXTS = [0, 0, 0, 0, 16, 20, 15, 16, 31, 32, 47, 100, 0]
MIXED_QUERIES = [15, 16, 17, 33, 17, 12, 1, 1, 1, 1, 1, 1, 1]
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 3e-2}


def run_both(context_lens, query_lens, num_heads, num_kv_heads, head_dim, dtype=torch.float64, seed=0,
             **options) -> tuple[torch.Tensor, torch.Tensor]:
    """(blockwise in `dtype`, torch-gather in float64) on one random pool and batch."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-(c + q) // BLOCK_SIZE) for c, q in zip(context_lens, query_lens)]
    order = torch.randperm(sum(needed) + 3, generator=gen).tolist()  # out-of-order tables
    tables = [order[sum(needed[:b]) : sum(needed[: b + 1])] for b in range(len(needed))]
    shape = (len(order), BLOCK_SIZE, num_kv_heads, head_dim)
    key_pool, value_pool = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen)
    metadata = AttentionMetadata.build(tables, context_lens, query_lens, block_size=BLOCK_SIZE, device="cpu")
    outs = []
    for backend, as_dtype in ((BlockwiseBackend(**options), dtype), (TorchGatherBackend(), torch.float64)):
        q, k_pool, v_pool = (t.to(as_dtype) for t in (query, key_pool, value_pool))
        # This step's keys and values are already in the pool; a backend may also read them from here.
        key = k_pool.view(-1, num_kv_heads, head_dim)[metadata.slot_mapping]  # (N, KV, d)
        value = v_pool.view(-1, num_kv_heads, head_dim)[metadata.slot_mapping]
        outs.append(backend.forward(q, key, value, k_pool, v_pool, backend.plan(metadata)))
    return outs[0], outs[1]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", GQA, ids=[f"gqa{h // kv}" for h, kv in GQA])
def test_mixed_batch_equals_the_reference(num_heads, num_kv_heads, head_dim, dtype) -> None:
    # Tiles of 32 keys and groups of at most 3 decodes: long sequences take several tiles each.
    out, reference = run_both(MIXED_CONTEXTS, MIXED_QUERIES, num_heads, num_kv_heads, head_dim, dtype,
                              tile_tokens=32, max_group_rows=3)
    assert out.shape == reference.shape and out.dtype == dtype
    assert (out.double() - reference).abs().max().item() < TOLERANCE[dtype]


@pytest.mark.parametrize("length", [15, 16, 17, 32, 33])
@pytest.mark.parametrize("tile_tokens", [16, 512])
def test_lengths_around_block_and_tile_boundaries(length: int, tile_tokens: int) -> None:
    # The same length as a fresh prefill, as an extend of 5 tokens and as a decode.
    out, reference = run_both([0, length - 5, length - 1], [length, 5, 1], 6, 2, 64, tile_tokens=tile_tokens)
    assert (out - reference).abs().max().item() < 1e-12


def test_decode_groups_of_very_different_lengths() -> None:
    # Lengths 1 to 300: several groups, and tiles where the shorter sequences of a group have no key.
    contexts = [0, 3, 40, 41, 90, 150, 151, 299]
    out, reference = run_both(contexts, [1] * len(contexts), 8, 1, 64, tile_tokens=64, max_group_rows=4)
    assert (out - reference).abs().max().item() < 1e-12


def test_online_softmax_merge_of_disjoint_key_sets_is_exact() -> None:
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 6, 3, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    k, v = k[:, :2].repeat(1, 1, 4, 1), v[:, :2].repeat(1, 1, 4, 1)  # 2 KV heads, 12 keys
    full, full_lse = attention_with_lse(q, k, v)
    scores = (q.view(2, 2, 3, 3, 16) @ k[:, :, None].transpose(-1, -2)).view(2, 6, 3, 12) * 16 ** -0.5
    assert torch.allclose(full_lse, torch.logsumexp(scores, -1))
    assert torch.allclose(full, torch.softmax(scores, -1) @ v.repeat_interleave(3, dim=1))
    parts = [attention_with_lse(q, k[:, :, s], v[:, :, s]) for s in (slice(0, 5), slice(5, 6), slice(6, 12))]
    assert torch.allclose(merge_partials([o for o, _ in parts], [lse for _, lse in parts]), full)
    # A part with no keys (log-sum-exp -inf) contributes nothing, whatever its output holds.
    empty = (torch.full_like(full, 7.0), torch.full_like(full_lse, float("-inf")))
    merged = merge_partials([parts[0][0], empty[0], parts[1][0], parts[2][0]],
                            [parts[0][1], empty[1], parts[1][1], parts[2][1]])
    assert torch.allclose(merged, full)


def test_causal_part_equals_sdpa() -> None:
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 5, 8, generator=gen)
    k, v = torch.randn(1, 2, 5, 8, generator=gen), torch.randn(1, 2, 5, 8, generator=gen)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    for dtype in (torch.float32, torch.float64):  # the CPU's fused kernel, and plain matmuls
        out, _ = attention_with_lse(q.to(dtype), k.to(dtype), v.to(dtype), is_causal=True)
        assert torch.allclose(out.float(), expected, atol=1e-6)


def test_bad_options_are_refused() -> None:
    with pytest.raises(ValueError):
        BlockwiseBackend(tile_tokens=0)
