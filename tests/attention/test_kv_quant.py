"""The quantized KV cache: round trips with their error bounds, the pool's bytes, the step's blocks
renumbered, and every attention backend reading an int8 or fp8 pool as it reads the dequantized one.
"""

from __future__ import annotations

import pytest
import torch

from llm_runtime.attention import AttentionMetadata, PagedAttentionStep, PagedKVCache, available_backends
from llm_runtime.attention.causal import causal_attention
from llm_runtime.attention.kv_cache import kv_block_bytes, num_blocks_in
from llm_runtime.attention.kv_quant import ChannelScale, KeyTurns, KVQuantization, KVScales, QuantizedPools, compact_step
from llm_runtime.attention.selector import backend_class
from llm_runtime.config import ModelConfig, RopeConfig
from llm_runtime.model.rope import RotaryEmbedding, apply_rotary

BLOCK_SIZE = 4
FLOAT32_BACKENDS = [name for name, reason in available_backends("cpu", torch.float32, BLOCK_SIZE).items()
                    if reason is None]


def test_int8_round_trip_is_within_half_a_step_of_its_channel_scale() -> None:
    gen = torch.Generator().manual_seed(0)
    size = torch.logspace(-3, 2, 64)  # channels of very different sizes, each off zero
    x = torch.randn(50, 3, 64, generator=gen) * size + 3 * size  # (N, KV, d)
    low, high = x.amin(0), x.amax(0)  # (KV, d)
    scale = ChannelScale.spanning(low, high)
    int8 = KVQuantization.of("int8", torch.float32)
    stored = int8.quantize(x, scale)
    assert stored.dtype == torch.int8 and stored.shape == x.shape
    assert stored.abs().max() <= 127 and (stored.amax(0) == 127).all() and (stored.amin(0) == -127).all()
    back = int8.dequantize(stored, scale, torch.float32)
    assert ((back - x).abs() <= 0.5 * scale.scale * (1 + 1e-4) + 1e-6 * x.abs()).all()
    # Beyond the range: clamped to its edge. With headroom, the edges lie further out.
    beyond = int8.round_trip(high[None] * 2 + 1, scale)
    assert torch.allclose(beyond[0], high, rtol=1e-5, atol=1e-6)
    wide = ChannelScale.spanning(low, high, headroom=1.25)
    assert torch.allclose(wide.scale, scale.scale * 1.25) and torch.equal(wide.zero, scale.zero)
    with pytest.raises(ValueError, match="needs its scales"):
        int8.quantize(x)
    with pytest.raises(ValueError, match="headroom"):
        ChannelScale.spanning(low, high, headroom=0.5)


def test_a_channel_that_never_moved_still_gets_a_step() -> None:
    low = torch.tensor([[0.0, 1.0, -2.0]])
    scale = ChannelScale.spanning(low, low + torch.tensor([[0.0, 0.0, 4.0]]))  # two channels without a range
    assert (scale.scale > 0).all() and torch.equal(scale.zero, torch.tensor([[0.0, 1.0, 0.0]]))
    int8 = KVQuantization.of("int8", torch.float32)
    assert torch.equal(int8.round_trip(low, scale)[0, :2], low[0, :2])  # its one value, exactly


def test_fp8_round_trip_has_a_relative_error_of_one_sixteenth() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4000, generator=gen) * 10
    fp8 = KVQuantization.of("fp8", torch.bfloat16)
    stored = fp8.quantize(x)
    assert stored.dtype == torch.float8_e4m3fn
    back = fp8.dequantize(stored, None, torch.float32)
    normal = x.abs() >= 2**-6
    assert ((back - x).abs()[normal] <= x.abs()[normal] * 2**-4).all()
    assert ((back - x).abs()[~normal] <= 2**-10).all()
    assert fp8.round_trip(torch.tensor([1e4, -1e4])).tolist() == [448.0, -448.0]


def test_key_turns_are_the_models_rotary_embedding_and_turning_back_undoes_them() -> None:
    rope, head_dim = RopeConfig(theta=10_000.0), 16
    x = torch.randn(2, 3, 7, head_dim, generator=torch.Generator().manual_seed(3))  # (B, KV, T, d), as the model has it
    positions = torch.tensor([0, 1, 5, 100, 1000, 4095, 8191])
    cos, sin = RotaryEmbedding(rope, head_dim)(positions[None], torch.float32)
    by_model = apply_rotary(x, cos, sin)
    turns = KeyTurns.of(rope, head_dim)
    turned = turns.turn(x.transpose(1, 2), positions).transpose(1, 2)  # (B, T, KV, d) in and out
    assert torch.allclose(turned, by_model, atol=1e-6)
    assert torch.allclose(turns.turn(turned.transpose(1, 2), positions, back=True).transpose(1, 2), x, atol=1e-5)
    table_cos, table_sin = turns.tables(3000)  # grown to the length asked, at least 1,024 positions
    assert table_cos.shape == table_sin.shape == (3000, head_dim // 2) and table_cos.is_contiguous()
    assert torch.allclose(table_cos[positions[:5]], cos[0, :5, : head_dim // 2], atol=1e-6)
    assert turns.tables(10)[0] is table_cos  # held, not recomputed
    with pytest.raises(ValueError, match="give its rope"):  # the angles its scales were measured with
        PagedKVCache(1, 2, 2, 3, head_dim, dtype=torch.float32, device="cpu", kv_cache_dtype="int8",
                     kv_scales=KVScales.uniform(1, 3, head_dim, 4.0))
    with pytest.raises(ValueError, match="need the model's key_turns"):
        QuantizedPools(KVQuantization.of("int8", torch.float32), torch.zeros(1, dtype=torch.int8),
                       torch.zeros(1, dtype=torch.int8), None, None)
    with pytest.raises(ValueError, match="give the keys' positions"):
        PagedKVCache(1, 2, 2, 3, head_dim, dtype=torch.float32, device="cpu", kv_cache_dtype="int8",
                     kv_scales=KVScales.uniform(1, 3, head_dim, 4.0), rope=rope).write(0, torch.tensor([0]), x[0, :, :1].transpose(0, 1),
                                                                            x[0, :, :1].transpose(0, 1))


def test_a_quantized_pool_holds_four_times_the_tokens_of_a_float32_one() -> None:
    config = ModelConfig("llama", 100, 576, 1536, 30, 9, 3, 64, 2048)  # the bundled model's shape
    full = kv_block_bytes(config, 16, torch.float32)
    assert full == 16 * 2 * 30 * 3 * 64 * 4
    for kv_cache_dtype in ("int8", "fp8"):
        assert kv_block_bytes(config, 16, torch.float32, kv_cache_dtype) * 4 == full
    nbytes = 64 * 2**20
    assert num_blocks_in(nbytes, config, 16, torch.float32, "int8") == 4 * num_blocks_in(nbytes, config, 16,
                                                                                         torch.float32)
    scales = KVScales.uniform(30, 3, 64, 1.0)
    cache = PagedKVCache.for_model(config, 10, 16, dtype=torch.float32, device="cpu", kv_cache_dtype="int8",
                                   kv_scales=scales)
    assert scales.nbytes == 30 * 2 * 2 * 3 * 64 * 4  # scale and zero per layer, K and V, head and channel
    assert cache.nbytes == 10 * kv_block_bytes(config, 16, torch.float32, "int8") + scales.nbytes
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        KVQuantization.of("int4", torch.float32)
    with pytest.raises(ValueError, match="needs kv_scales"):
        PagedKVCache.for_model(config, 10, 16, dtype=torch.float32, device="cpu", kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="30 layers"):
        PagedKVCache.for_model(config, 10, 16, dtype=torch.float32, device="cpu", kv_cache_dtype="int8",
                               kv_scales=KVScales.uniform(29, 3, 64, 1.0))
    with pytest.raises(ValueError, match="takes no kv_scales"):
        PagedKVCache.for_model(config, 10, 16, dtype=torch.float32, device="cpu", kv_cache_dtype="fp8",
                               kv_scales=scales)


def test_write_skips_padding_and_copy_on_write_copies_blocks() -> None:
    cache = PagedKVCache(1, 4, 2, 1, 8, dtype=torch.float32, device="cpu", kv_cache_dtype="int8",
                         kv_scales=KVScales.uniform(1, 1, 8, 24.0), rope=RopeConfig())
    k = torch.arange(24, dtype=torch.float32).view(3, 1, 8)
    cache.write(0, torch.tensor([1, -1, 6]), k, -k, positions=torch.tensor([1, 0, 0]))
    keys, values = cache.read_blocks(0, torch.arange(4), block_starts=torch.tensor([0, 2, 4, 0]))  # (4, 2, 1, 8)
    flat = keys.view(8, 8)
    assert torch.allclose(flat[1], k[0, 0], atol=0.1) and torch.allclose(flat[6], k[2, 0], atol=0.1)
    assert flat[[0, 2, 3, 4, 5, 7]].abs().max() == 0  # the padded row wrote nowhere
    cache.copy_blocks([(3, 0)])  # slot 6 -> slot 0
    assert torch.equal(cache.read_blocks(0, torch.tensor([0]), torch.tensor([0]))[1].view(2, 8)[0], values.view(8, 8)[6])


def test_compact_step_renumbers_tables_and_slots() -> None:
    metadata = AttentionMetadata.build([[7, 3], [5], [9, 2, 8]], [5, 0, 9], [1, 2, 1], block_size=4, device="cpu")
    compact = compact_step(metadata)
    assert compact.blocks.tolist() == [0, 2, 3, 5, 7, 8, 9]
    assert compact.block_starts.tolist() == [0, 4, 4, 0, 0, 8, 0]  # column times block size (0: padding)
    assert metadata.token_positions().tolist() == [5, 0, 1, 9]
    blocks = compact.blocks
    # Every table entry and every slot names the same block after renumbering.
    assert torch.equal(blocks[compact.metadata.block_tables.long()][:, :2], metadata.block_tables.long()[:, :2])
    slots, new = metadata.slot_mapping, compact.metadata.slot_mapping
    assert torch.equal(blocks[new // 4] * 4 + new % 4, slots)
    assert compact.metadata.block_tables_host == ((4, 2), (3,), (6, 1, 5))


def _reference(cache: PagedKVCache, query, keys, values, seq_lens, query_lens) -> torch.Tensor:
    """Causal attention per sequence over its keys and values quantized and read back."""
    outs, row = [], 0
    for b, (length, count) in enumerate(zip(seq_lens, query_lens)):
        k, v = cache.stored_as(0, keys[b], values[b], torch.arange(length))  # (S, KV, d) each
        q = query[row : row + count]  # (T, H, d)
        out = causal_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                               length - count)  # (1, H, T, d)
        outs.append(out[0].transpose(0, 1))
        row += count
    return torch.cat(outs)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("backend", FLOAT32_BACKENDS)
def test_every_backend_reads_the_quantized_pool(backend: str, kv_cache_dtype: str) -> None:
    """A ragged step (a fresh prefill, an extend over a cached prefix, decodes at block edges) over a pool
    whose earlier tokens were written quantized: each backend equals attention over the read-back keys."""
    gen = torch.Generator().manual_seed(2)
    num_heads, num_kv_heads, head_dim = 4, 2, 16
    contexts, counts = [0, 6, 4, 7, 11], [5, 3, 1, 1, 1]
    lengths = [c + n for c, n in zip(contexts, counts)]
    needed = [-(-length // BLOCK_SIZE) for length in lengths]
    order = torch.randperm(sum(needed) + 2, generator=gen).tolist()
    tables = [order[sum(needed[:b]) : sum(needed[: b + 1])] for b in range(len(lengths))]
    offsets = torch.linspace(-2, 2, head_dim)  # channels off zero: int8's zeros matter
    keys = [torch.randn(n, num_kv_heads, head_dim, generator=gen) * 3 + offsets for n in lengths]
    values = [torch.randn(n, num_kv_heads, head_dim, generator=gen) - offsets for n in lengths]
    scales = None
    if kv_cache_dtype == "int8":  # each channel's range over these keys and values, as a calibration finds it
        every_key, every_value = torch.cat(keys), torch.cat(values)
        spans = [ChannelScale.spanning(x.amin(0), x.amax(0)) for x in (every_key, every_value)]
        scales = KVScales((spans[0],), (spans[1],))
    cache = PagedKVCache(1, len(order), BLOCK_SIZE, num_kv_heads, head_dim, dtype=torch.float32, device="cpu",
                         kv_cache_dtype=kv_cache_dtype, kv_scales=scales, rope=RopeConfig(theta=100.0))  # turns fast
    history = AttentionMetadata.build(tables, [0] * len(lengths), contexts, block_size=BLOCK_SIZE, device="cpu")
    cache.write(0, history.slot_mapping, torch.cat([k[:c] for k, c in zip(keys, contexts)]),
                torch.cat([v[:c] for v, c in zip(values, contexts)]), history.token_positions())
    metadata = AttentionMetadata.build(tables, contexts, counts, block_size=BLOCK_SIZE, device="cpu")
    query = torch.randn(sum(counts), num_heads, head_dim, generator=gen)
    step = PagedAttentionStep(cache, backend_class(backend)(), metadata)
    new_k = torch.cat([k[c:] for k, c in zip(keys, contexts)])  # (N, KV, d)
    new_v = torch.cat([v[c:] for v, c in zip(values, contexts)])
    out = step.attend(0, query.transpose(0, 1)[None], new_k.transpose(0, 1)[None], new_v.transpose(0, 1)[None])
    expected = _reference(cache, query, keys, values, lengths, counts)
    assert (out[0].transpose(0, 1) - expected).abs().max() < 1e-4
