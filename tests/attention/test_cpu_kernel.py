"""The C paged-decode kernel, the C KV store and the `cpu` backend equal the torch-gather reference, and fail safely.

Random pools with shuffled block tables (reading a wrong block shows), GQA groups of 1, 3, 4 and
8, head dims 64 and 128 and one that is not a multiple of the vector width (40), block sizes 1,
16 and 32, lengths around block and chunk edges, float32 and bfloat16, a strided query, and the
whole mixed batch through the backend. An 8-bit pool (int8 with scales, float8 e4m3fn) read as stored
equals the same kernel over that pool converted to float32 beforehand, in every build. Then the guards: bad dtypes and indices are refused before
the C code runs, and without a compiler the engine falls back to the block-wise backend.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from llm_runtime.attention import available_backends, select_backend
from llm_runtime.attention import cpu_kernels
from llm_runtime.attention.cpu_backend import CpuKernelBackend
from llm_runtime.attention.cpu_kernels import KernelUnavailable, check_indices, paged_decode, paged_decode_quantized
from llm_runtime.attention.kv_quant import ChannelScale, KeyTurns, KVQuantization, QuantizedPools
from llm_runtime.attention.metadata import AttentionMetadata
from llm_runtime.attention.torch_gather import TorchGatherBackend
from llm_runtime.config import RopeConfig

pytestmark = pytest.mark.skipif(cpu_kernels.kernel_unavailable_reason() is not None,
                                reason="no C compiler builds the kernel here")

GQA = [(2, 2), (6, 2), (4, 1), (8, 1)]  # (H, KV): 1, 3, 4 and 8 query heads per KV head
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}
# Lengths 1 to 70: one key, block and chunk (16 keys) edges, several chunks.
DECODE_LENGTHS = [1, 2, 15, 16, 17, 31, 32, 33, 47, 70]


def random_step(context_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size=16, seed=0):
    """A float64 pool with out-of-order block tables, the step's metadata and its queries."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-(c + q) // block_size) for c, q in zip(context_lens, query_lens)]
    order = torch.randperm(sum(needed) + 3, generator=gen).tolist()
    tables = [order[sum(needed[:b]) : sum(needed[: b + 1])] for b in range(len(needed))]
    shape = (len(order), block_size, num_kv_heads, head_dim)
    pools = torch.randn(shape, generator=gen, dtype=torch.float64), torch.randn(shape, generator=gen,
                                                                                  dtype=torch.float64)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen, dtype=torch.float64)
    metadata = AttentionMetadata.build(tables, context_lens, query_lens, block_size=block_size, device="cpu")
    return metadata, pools, query


def run(backend, metadata, pools, query, dtype):
    q, key_pool, value_pool = (t.to(dtype) for t in (query, *pools))
    num_kv_heads, head_dim = key_pool.shape[2:]
    key = key_pool.view(-1, num_kv_heads, head_dim)[metadata.slot_mapping]  # (N, KV, d): already stored
    value = value_pool.view(-1, num_kv_heads, head_dim)[metadata.slot_mapping]
    return backend.forward(q, key, value, key_pool, value_pool, backend.plan(metadata))


def error_against_reference(context_lens, query_lens, num_heads, num_kv_heads, head_dim, dtype,
                            block_size=16) -> float:
    metadata, pools, query = random_step(context_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size)
    out = run(CpuKernelBackend(), metadata, pools, query, dtype)
    reference = run(TorchGatherBackend(), metadata, pools, query, torch.float64)
    assert out.shape == reference.shape and out.dtype == dtype
    return (out.double() - reference).abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128, 40])
@pytest.mark.parametrize("num_heads,num_kv_heads", GQA, ids=[f"gqa{h // kv}" for h, kv in GQA])
def test_decodes_equal_the_reference(num_heads, num_kv_heads, head_dim, dtype) -> None:
    contexts = [length - 1 for length in DECODE_LENGTHS]
    error = error_against_reference(contexts, [1] * len(contexts), num_heads, num_kv_heads, head_dim, dtype)
    assert error < TOLERANCE[dtype]


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_block_sizes(block_size: int) -> None:
    contexts = [length - 1 for length in DECODE_LENGTHS]
    error = error_against_reference(contexts, [1] * len(contexts), 6, 2, 64, torch.float32, block_size)
    assert error < TOLERANCE[torch.float32]


def test_a_mixed_batch_is_one_list_of_rows_each_a_decode_of_its_own_length() -> None:
    # Fresh prefills, extends over a cached prefix and decodes, interleaved in one batch.
    contexts = [0, 16, 0, 20, 31, 0, 99]
    queries = [15, 1, 17, 12, 1, 33, 1]
    assert error_against_reference(contexts, queries, 6, 2, 64, torch.float32) < TOLERANCE[torch.float32]
    metadata, _, _ = random_step(contexts, queries, 6, 2, 64)
    plan = CpuKernelBackend().plan(metadata)
    rows = plan.kernel_rows
    assert rows.rows.tolist() == list(range(sum(queries))) and plan.prefills == []  # every row of the flat batch
    # A prefill chunk's rows see 1, 2, ... keys past its context; a decode sees its whole sequence.
    expected = [c + i + 1 for c, q in zip(contexts, queries) for i in range(q)]
    assert rows.seq_lens.tolist() == expected
    tables = metadata.block_tables.tolist()
    assert rows.block_tables.tolist() == [tables[b] for b, q in enumerate(queries) for _ in range(q)]


def test_a_decode_step_is_planned_as_a_mixed_batch_would_be() -> None:
    # A step of one new token per sequence takes a shortcut (no tensors rebuilt): the same rows, lengths, tables
    # and largest block as the general plan, and the same refusals.
    contexts = [0, 16, 5, 31, 99]
    metadata, _, _ = random_step(contexts, [1] * len(contexts), 6, 2, 64)
    decode, general = CpuKernelBackend._plan_decode_rows(metadata), CpuKernelBackend()._plan_mixed_rows(metadata)
    for field in ("rows", "block_tables", "seq_lens"):
        assert torch.equal(getattr(decode, field), getattr(general, field)), field
    assert decode.max_block == general.max_block
    broken = replace(metadata, block_tables_host=((-1,),) + metadata.block_tables_host[1:])
    with pytest.raises(ValueError, match="negative"):
        CpuKernelBackend._plan_decode_rows(broken)


def test_chunks_longer_than_kernel_max_rows_go_block_wise() -> None:
    contexts, queries = [0, 16, 40, 3], [9, 1, 20, 1]
    backend = CpuKernelBackend()
    backend.kernel_max_rows = 8  # the 9- and 20-row chunks are long here
    metadata, pools, query = random_step(contexts, queries, 6, 2, 64)
    plan = backend.plan(metadata)
    assert plan.kernel_rows.rows.tolist() == [9, 30] and [(c.begin, c.end) for c in plan.prefills] == [(0, 9), (10, 30)]
    out = run(backend, metadata, pools, query, torch.float32)
    reference = run(TorchGatherBackend(), metadata, pools, query, torch.float64)
    assert (out.double() - reference).abs().max().item() < TOLERANCE[torch.float32]
    backend.kernel_max_rows = 0  # every prefill block-wise, and no decode: no kernel rows
    assert backend.plan(random_step([0], [5], 6, 2, 64)[0]).kernel_rows is None


def test_a_step_of_prefills_only_or_decodes_only() -> None:
    assert error_against_reference([0, 3], [5, 4], 4, 1, 64, torch.float32) < TOLERANCE[torch.float32]
    assert error_against_reference([4, 9], [1, 1], 4, 1, 64, torch.float32) < TOLERANCE[torch.float32]
    assert CpuKernelBackend().plan(random_step([], [], 4, 1, 64)[0]).kernel_rows is None  # an empty step


def test_the_c_store_writes_through_the_slot_mapping_and_skips_padding() -> None:
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        key_pool, value_pool = torch.zeros(5, 4, 3, 8, dtype=dtype), torch.zeros(5, 4, 3, 8, dtype=dtype)
        expected_keys, expected_values = key_pool.clone(), value_pool.clone()
        qkv = torch.randn(6, 2, 3, 8, generator=gen).to(dtype)
        key, value = qkv[:, 0], qkv[:, 1]  # (N, KV, d), strided as the model's projections are
        slots = torch.tensor([7, -1, 0, 19, 12, -1])  # -1: padded rows write nowhere
        cpu_kernels.store_kv(key_pool, value_pool, slots, key, value)
        TorchGatherBackend().store_kv(expected_keys, expected_values, slots, key, value)
        assert torch.equal(key_pool, expected_keys) and torch.equal(value_pool, expected_values)
        with pytest.raises(ValueError, match="outside"):
            cpu_kernels.store_kv(key_pool, value_pool, torch.tensor([0, 1, 2, 3, 20, 4]), key, value)
        assert torch.equal(key_pool, expected_keys)  # nothing written when one slot is bad
        with pytest.raises(ValueError, match="shapes disagree"):
            cpu_kernels.store_kv(key_pool, value_pool, slots[:5], key, value)
        with pytest.raises(TypeError, match="one dtype"):
            cpu_kernels.store_kv(key_pool, value_pool, slots, key.double(), value)


def test_a_strided_query_is_read_through_its_strides() -> None:
    metadata, pools, query = random_step([5, 40], [1, 1], 6, 2, 64)
    key_pool, value_pool = (p.float() for p in pools)
    wide = torch.randn(2, 6, 128)
    wide[:, :, :64] = query.float()
    strided = wide[:, :, :64]  # (N, H, d) with a row stride of 6 * 128
    rows = CpuKernelBackend().plan(metadata).kernel_rows
    out = torch.zeros(2, 6, 64)
    paged_decode(strided, key_pool, value_pool, rows.block_tables, rows.seq_lens, rows.rows, out)
    reference = run(TorchGatherBackend(), metadata, pools, query, torch.float64)
    assert (out.double() - reference).abs().max().item() < TOLERANCE[torch.float32]


def test_bad_inputs_are_refused_before_the_c_code_runs() -> None:
    metadata, pools, query = random_step([5, 40], [1, 1], 6, 2, 64)
    key_pool, value_pool = (p.float() for p in pools)
    decodes = CpuKernelBackend().plan(metadata).kernel_rows
    args = (key_pool, value_pool, decodes.block_tables, decodes.seq_lens, decodes.rows)
    out = torch.empty(2, 6, 64)
    with pytest.raises(TypeError, match="float32"):
        paged_decode(query, *args, out)  # a float64 query
    with pytest.raises(ValueError, match="seq_lens"):
        paged_decode(query.float(), key_pool, value_pool, decodes.block_tables, decodes.seq_lens + 1000,
                     decodes.rows, out)
    with pytest.raises(ValueError, match="rows"):
        paged_decode(query.float(), *args[:4], decodes.rows + 5, out)
    with pytest.raises(ValueError, match="block table entries"):
        check_indices(decodes.block_tables + 100, decodes.seq_lens, decodes.rows, num_rows=2,
                      num_blocks=key_pool.shape[0], block_size=16)
    with pytest.raises(ValueError, match="contiguous"):
        paged_decode(query.float(), key_pool.transpose(1, 2), *args[1:], out)
    with pytest.raises(ValueError, match="shapes disagree"):
        paged_decode(query.float(), *args, torch.empty(2, 6, 32))
    with pytest.raises(ValueError, match="at most 256 query heads"):  # the C code's own limits
        big_pool = torch.zeros(4, 16, 1, 32)
        paged_decode(torch.zeros(1, 1024, 32), big_pool, big_pool, torch.zeros(1, 1, dtype=torch.int32),
                     torch.ones(1, dtype=torch.int32), torch.zeros(1, dtype=torch.long), torch.empty(1, 1024, 32))


def test_the_engine_picks_it_on_the_cpu_in_float32_and_bfloat16_only() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        assert select_backend("auto", "cpu", dtype).name == "cpu"
    assert select_backend("auto", "cpu", torch.float64).name == "blockwise"  # the kernel has no float64
    assert "float64" in available_backends("cpu", torch.float64)["cpu"]
    assert "CPU" in available_backends("cuda", torch.float32)["cpu"]


def test_without_a_compiler_the_engine_falls_back_to_blockwise(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("CC", "/bin/false")  # a "compiler" that fails every build
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # and no library built before
    cpu_kernels.load_library.cache_clear()
    try:
        with pytest.raises(KernelUnavailable, match="did not compile"):
            cpu_kernels.load_library()
        assert "did not compile" in available_backends("cpu", torch.float32)["cpu"]
        assert select_backend("auto", "cpu", torch.float32).name == "blockwise"
        with pytest.raises(ValueError, match="'cpu' cannot run"):
            select_backend("cpu", "cpu", torch.float32)
    finally:
        cpu_kernels.load_library.cache_clear()
        monkeypatch.undo()
    assert cpu_kernels.kernel_unavailable_reason() is None  # the real compiler again


def test_the_library_is_built_once_and_reused_from_the_cache(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cpu_kernels.load_library.cache_clear()
    try:
        cpu_kernels.load_library()
        (built,) = (tmp_path / "llm_runtime" / "kernels").glob("paged_decode-*.so")
        first_build = built.stat().st_mtime_ns
        cpu_kernels.load_library.cache_clear()  # as a new process would
        cpu_kernels.load_library()
        assert built.stat().st_mtime_ns == first_build  # loaded, not compiled again
    finally:
        cpu_kernels.load_library.cache_clear()


@pytest.mark.parametrize("flags", [("-O3", "-mavx2", "-mfma", "-fopenmp"), ("-O3",)], ids=["avx2", "plain-c"])
def test_the_avx2_and_plain_c_builds_equal_the_reference(monkeypatch, tmp_path, flags) -> None:
    """The AVX-512 build is what this machine runs; a laptop may build the other two paths."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(cpu_kernels, "FLAG_SETS", (flags,))
    cpu_kernels.load_library.cache_clear()
    try:
        contexts = [length - 1 for length in DECODE_LENGTHS]
        for dtype in (torch.float32, torch.bfloat16):
            for head_dim in (64, 40):
                error = error_against_reference(contexts, [1] * len(contexts), 6, 2, head_dim, dtype)
                assert error < TOLERANCE[dtype], (dtype, head_dim)
    finally:
        cpu_kernels.load_library.cache_clear()


def test_a_block_outside_the_pool_is_refused_before_the_c_code_runs() -> None:
    metadata, pools, query = random_step([5, 40], [1, 1], 6, 2, 64)
    small_pools = [p[:2].float().contiguous() for p in pools]  # fewer blocks than the tables name
    backend = CpuKernelBackend()
    with pytest.raises(ValueError, match="outside a pool of 2 blocks"):
        backend.forward(query.float(), None, None, *small_pools, backend.plan(metadata))


def stored_values(pool: torch.Tensor) -> torch.Tensor:
    """A float64 pool as the 8-bit tests store it: one magnitude per channel, 1e-4 .. 30, so that float8's
    subnormals and int8's range both show, and each channel off zero by half its size (int8's zeros)."""
    spread = torch.logspace(-4, 1.5, pool.shape[-1], dtype=torch.float64)
    return (pool * spread + spread / 2).float()


def quantized_pools(pools, kv_cache_dtype: str, metadata: AttentionMetadata) -> tuple[QuantizedPools, list]:
    """(key, value) float64 pools -> the 8-bit pools as stored with their scales (int8: each channel's range
    over the pool, keys stored turned back by the rotary embedding), and the float32 pools they stand for
    (what the kernel must read: int8's keys turned to the positions `metadata`'s tables give their slots)."""
    quantization = KVQuantization.of(kv_cache_dtype, torch.float32)
    stored, scales = [], []
    for pool in pools:
        x = stored_values(pool)  # (num_blocks, block_size, KV, d)
        scale = ChannelScale.spanning(x.amin(dim=(0, 1)), x.amax(dim=(0, 1))) if quantization.scaled else None
        stored.append(quantization.quantize(x, scale))
        scales.append(scale)
    head_dim = pools[0].shape[-1]
    turns = KeyTurns.of(RopeConfig(theta=100.0), head_dim) if quantization.turns_keys else None  # turns fast
    result = QuantizedPools(quantization, stored[0], stored[1], scales[0], scales[1], turns)
    starts = metadata.block_starts()
    every_block = torch.arange(pools[0].shape[0])
    block_starts = torch.tensor([starts.get(int(b), 0) for b in every_block])
    return result, list(result.read_blocks(every_block, block_starts, torch.float32))


def read_quantized(query, pools: QuantizedPools, metadata, rows, out) -> None:
    paged_decode_quantized(query, pools.key_pool, pools.value_pool, pools.key_scale, pools.value_scale,
                           metadata.block_tables, metadata.seq_lens, rows, out, key_turns=pools.key_turns)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 40])
def test_an_8bit_pool_is_read_as_stored(kv_cache_dtype, dtype, head_dim) -> None:
    contexts = [length - 1 for length in DECODE_LENGTHS]
    metadata, pools, query = random_step(contexts, [1] * len(contexts), 6, 2, head_dim)
    stored, read_back = quantized_pools(pools, kv_cache_dtype, metadata)
    assert stored.key_pool.element_size() == 1
    q = query.to(dtype)
    out = torch.full(q.shape, float("nan"), dtype=dtype)
    read_quantized(q, stored, metadata, (metadata.query_start_loc[1:] - 1).long(), out)
    expected = torch.empty(q.shape, dtype=torch.float32)
    paged_decode(q.float(), *read_back, metadata.block_tables, metadata.seq_lens,
                 (metadata.query_start_loc[1:] - 1).long(), expected)
    assert (out.float() - expected).abs().max() < TOLERANCE[dtype] * expected.abs().max()  # relative: up to 36


@pytest.mark.parametrize("flags", [("-O3", "-mavx2", "-mfma", "-fopenmp"), ("-O3",)], ids=["avx2", "plain-c"])
def test_the_avx2_and_plain_c_builds_read_8bit_pools_as_stored(monkeypatch, tmp_path, flags) -> None:
    """The float8 conversion is written three times (AVX-512 by way of float16, AVX2 by bits, scalar)."""
    contexts = [length - 1 for length in DECODE_LENGTHS]
    metadata, pools, query = random_step(contexts, [1] * len(contexts), 6, 2, 40)
    rows = (metadata.query_start_loc[1:] - 1).long()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(cpu_kernels, "FLAG_SETS", (flags,))
    cpu_kernels.load_library.cache_clear()
    try:
        for kv_cache_dtype in ("int8", "fp8"):
            stored, read_back = quantized_pools(pools, kv_cache_dtype, metadata)
            out, expected = torch.empty(query.shape), torch.empty(query.shape)
            read_quantized(query.float(), stored, metadata, rows, out)
            paged_decode(query.float(), *read_back, metadata.block_tables, metadata.seq_lens, rows, expected)
            assert (out - expected).abs().max() < 1e-5 * expected.abs().max(), kv_cache_dtype
    finally:
        cpu_kernels.load_library.cache_clear()


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_the_backend_reads_an_8bit_pool_in_place_and_long_chunks_over_a_copy_of_their_prefix(kv_cache_dtype):
    """Decodes and short chunks through the kernel over the stored pool; the long chunks block-wise over
    a float copy of the blocks their cached prefixes read, renumbered."""
    contexts, queries = [0, 16, 40, 3, 21], [9, 1, 20, 1, 12]
    backend = CpuKernelBackend()
    backend.kernel_max_rows = 8  # the 9-, 12- and 20-row chunks are long here
    metadata, pools, query = random_step(contexts, queries, 6, 2, 64)
    stored, read_back = quantized_pools(pools, kv_cache_dtype, metadata)
    key_pool = stored.key_pool
    plan = backend.plan(metadata)
    long_prefix = sorted({b for chunk in plan.prefills for blocks, _ in chunk.prefix_tiles for b in blocks.tolist()})
    assert plan.quantized_prefills.blocks.tolist() == long_prefix  # the 20-row and 12-row chunks' prefixes
    assert 0 < len(long_prefix) < key_pool.shape[0]  # a copy of some blocks, not of the pool
    num_kv_heads, head_dim = key_pool.shape[2:]
    # The step's own keys and values in full precision (the backend rounds them as stored; int8's keys as the
    # model has them, turned to their positions) and as read back.
    key, value = (stored_values(pool).view(-1, num_kv_heads, head_dim)[metadata.slot_mapping] for pool in pools)
    if stored.key_turns is not None:
        key = stored.key_turns.turn(key, metadata.token_positions())
    read_key, read_value = (pool.view(-1, num_kv_heads, head_dim)[metadata.slot_mapping] for pool in read_back)
    assert not torch.equal(key, read_key)
    out = backend.forward_quantized(query.float(), key, value, stored, plan)
    reference = TorchGatherBackend()
    expected = reference.forward(query.float(), read_key, read_value, *read_back, reference.plan(metadata))
    assert (out - expected).abs().max() < 1e-5 * expected.abs().max()


def test_bad_8bit_pools_are_refused_before_the_c_code_runs() -> None:
    metadata, pools, query = random_step([5, 40], [1, 1], 6, 2, 64)
    rows, out = (metadata.query_start_loc[1:] - 1).long(), torch.empty(query.shape)
    args = (metadata.block_tables, metadata.seq_lens, rows, out)
    stored, _ = quantized_pools(pools, "int8", metadata)
    key_pool, value_pool, key_scales, value_scales, turns = (stored.key_pool, stored.value_pool, stored.key_scale,
                                                             stored.value_scale, stored.key_turns)
    with pytest.raises(ValueError, match="needs its key and value scales"):
        paged_decode_quantized(query.float(), key_pool, value_pool, None, None, *args, key_turns=turns)
    with pytest.raises(ValueError, match="the model's key_turns"):
        paged_decode_quantized(query.float(), key_pool, value_pool, key_scales, value_scales, *args)
    with pytest.raises(ValueError, match="per KV head and channel"):
        wrong = ChannelScale(key_scales.scale[:, :32], key_scales.zero[:, :32])  # half the channels
        paged_decode_quantized(query.float(), key_pool, value_pool, wrong, value_scales, *args, key_turns=turns)
    with pytest.raises(ValueError, match="key_turns for heads of 32"):
        paged_decode_quantized(query.float(), key_pool, value_pool, key_scales, value_scales, *args,
                               key_turns=KeyTurns.of(RopeConfig(), 32))
    with pytest.raises(TypeError, match="quantized C kernel reads"):
        paged_decode_quantized(query.float(), key_pool, value_pool.view(torch.uint8), key_scales, value_scales,
                               *args, key_turns=turns)
    fp8, _ = quantized_pools(pools, "fp8", metadata)
    with pytest.raises(ValueError, match="has no scales"):
        paged_decode_quantized(query.float(), fp8.key_pool, fp8.value_pool, key_scales, value_scales, *args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_operator_for_compiled_graphs_stores_then_attends_as_the_backend_does(dtype) -> None:
    """`cpu_paged_attention`, one layer's attention as one PyTorch operator: the backend's `store_kv` then
    `forward` (a mixed batch: decodes and a prefill chunk over its cached prefix), pools written alike; its
    schema, fake version and mutation annotations pass PyTorch's operator checks."""
    metadata, pools, query = random_step([0, 9, 30], [5, 1, 4], 6, 2, 64)
    backend = CpuKernelBackend()
    plan = backend.plan(metadata)
    inputs = backend.compiled_inputs(plan, pools[0].shape[0])
    assert inputs is not None
    gen = torch.Generator().manual_seed(1)
    key, value = (torch.randn(metadata.num_tokens, 2, 64, generator=gen).to(dtype) for _ in range(2))
    query = query.to(dtype)
    expected_pools = [p.to(dtype) for p in pools]
    backend.store_kv(*expected_pools, metadata.slot_mapping, key, value)
    expected = backend.forward(query, key, value, *expected_pools, plan)
    key_pool, value_pool = (p.to(dtype) for p in pools)
    out = cpu_kernels.cpu_paged_attention(query, key, value, key_pool, value_pool, metadata.slot_mapping, *inputs)
    assert torch.equal(out, expected)
    assert torch.equal(key_pool, expected_pools[0]) and torch.equal(value_pool, expected_pools[1])
    torch.library.opcheck(cpu_kernels.cpu_paged_attention,
                          (query, key, value, key_pool, value_pool, metadata.slot_mapping, *inputs))
    with pytest.raises(TypeError, match="one dtype"):
        cpu_kernels.cpu_paged_attention(query.double(), key, value, key_pool, value_pool, metadata.slot_mapping,
                                        *inputs)


def operator_inputs() -> list[torch.Tensor]:
    """Arguments of `cpu_paged_attention` in its schema's order: query, key, value, key_pool, value_pool,
    slot_mapping, block_tables, seq_lens, rows; 2 of 3 rows attended, over pools of 6 blocks of 4."""
    gen = torch.Generator().manual_seed(0)
    pools = [torch.randn(6, 4, 2, 64, generator=gen) for _ in range(2)]
    query = torch.randn(3, 6, 64, generator=gen)
    key, value = (torch.randn(3, 2, 64, generator=gen) for _ in range(2))
    tables = torch.tensor([[3, 1, 0], [2, 5, 4]], dtype=torch.int32)
    return [query, key, value, *pools, torch.tensor([5, 9, -1]), tables, torch.tensor([6, 10], dtype=torch.int32),
            torch.tensor([0, 1])]


# (what is wrong, the argument, its replacement, the error, its message): each would have the C code read
# outside a tensor, or read one as the wrong type. The operator is public (torch.ops.llm_runtime), so it checks.
QUERY, SLOTS, TABLES, LENGTHS, ROWS = 0, 5, 6, 7, 8
BAD_OPERATOR_INPUTS = [
    ("tables-int64", TABLES, lambda t: t.long(), TypeError, "int32"),
    ("lengths-int64", LENGTHS, lambda t: t.long(), TypeError, "int32"),
    ("rows-int32", ROWS, lambda t: t.int(), TypeError, "int64"),
    ("slots-int32", SLOTS, lambda t: t.int(), TypeError, "int64"),
    ("tables-strided", TABLES, lambda t: t.repeat_interleave(2, dim=1)[:, ::2], ValueError, "contiguous"),
    ("tables-1d", TABLES, lambda t: t.flatten(), ValueError, "shapes disagree"),
    ("lengths-short", LENGTHS, lambda t: t[:1], ValueError, "shapes disagree"),
    ("block-past-the-pool", TABLES, lambda t: torch.tensor([[3, 1, 0], [2, 5, 6]], dtype=torch.int32), ValueError,
     "block table entries"),
    ("negative-block", TABLES, lambda t: torch.tensor([[3, 1, 0], [2, -1, 4]], dtype=torch.int32), ValueError,
     "block table entries"),
    ("length-past-the-table", LENGTHS, lambda t: torch.tensor([6, 13], dtype=torch.int32), ValueError, "seq_lens"),
    ("row-past-the-batch", ROWS, lambda t: torch.tensor([0, 3]), ValueError, "rows"),
    ("query-head-dim", QUERY, lambda q: q[..., :32].contiguous(), ValueError, "shapes disagree"),
]


@pytest.mark.parametrize("what,argument,replace_with,error,message", BAD_OPERATOR_INPUTS,
                         ids=[case[0] for case in BAD_OPERATOR_INPUTS])
def test_the_operator_refuses_what_the_c_code_would_misread_and_writes_nothing(what, argument, replace_with, error,
                                                                             message) -> None:
    inputs = operator_inputs()
    assert cpu_kernels.cpu_paged_attention(*inputs).shape == (3, 6, 64)  # as given, they are fine
    inputs = operator_inputs()
    inputs[argument] = replace_with(inputs[argument])
    pools = [pool.clone() for pool in inputs[3:5]]
    with pytest.raises(error, match=message):
        cpu_kernels.cpu_paged_attention(*inputs)
    assert torch.equal(inputs[3], pools[0]) and torch.equal(inputs[4], pools[1])  # refused before the store


def test_a_step_with_a_long_chunk_has_no_compiled_inputs() -> None:
    metadata, pools, _ = random_step([0, 9], [600, 1], 2, 2, 64)
    backend = CpuKernelBackend()
    assert backend.compiled_inputs(backend.plan(metadata), pools[0].shape[0]) is None  # block-wise: eager
    short, pools, _ = random_step([0, 9], [6, 1], 2, 2, 64)
    with pytest.raises(ValueError, match="outside a pool"):
        backend.compiled_inputs(backend.plan(short), 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_c_int8_store_writes_the_bytes_the_python_path_writes(dtype) -> None:
    """Keys turned back by their positions, every element rounded with its channel's scale: in one C call,
    the same bytes as `QuantizedPools.write`, padding rows skipped; a bad slot writes nothing."""
    gen = torch.Generator().manual_seed(5)
    num_blocks, block_size, num_kv_heads, head_dim = 6, 4, 2, 64
    size = torch.logspace(-2, 1, head_dim)  # channels of different sizes, off zero
    key = (torch.randn(7, num_kv_heads, head_dim, generator=gen) * size + size).to(dtype)
    value = (torch.randn(7, num_kv_heads, head_dim, generator=gen) * size - size).to(dtype)
    slots = torch.tensor([3, 9, -1, 0, 17, 22, 5])
    positions = torch.tensor([0, 1, 0, 40, 511, 6000, 3])
    scales = [ChannelScale.spanning(x.float().amin(0) * 0.9, x.float().amax(0) * 0.9) for x in (key, value)]  # some clamp
    turns = KeyTurns.of(RopeConfig(theta=10_000.0), head_dim)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    int8 = KVQuantization.of("int8", dtype)
    by_python, by_c = (QuantizedPools(int8, torch.zeros(shape, dtype=torch.int8), torch.zeros(shape, dtype=torch.int8),
                                      *scales, turns) for _ in range(2))
    by_python.write(slots, key, value, positions)
    cpu_kernels.store_kv_int8(by_c, slots, key.transpose(0, 1).contiguous().transpose(0, 1), value, positions)  # strided
    assert torch.equal(by_c.key_pool, by_python.key_pool) and torch.equal(by_c.value_pool, by_python.value_pool)
    assert by_c.key_pool.view(-1, num_kv_heads, head_dim)[[1, 2, 4]].abs().max() == 0  # nothing where nothing went
    with pytest.raises(ValueError, match="nothing written"):
        cpu_kernels.store_kv_int8(by_c, torch.tensor([0, 24]), key[:2], value[:2], positions[:2])
    with pytest.raises(TypeError, match="C int8 store takes"):
        cpu_kernels.store_kv_int8(by_c, slots, key.double(), value.double(), positions)
