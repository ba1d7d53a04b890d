"""The FlexAttention backend equals the torch-gather reference on mixed batches, without recompiling per step.

Every batch mixes the row kinds a step has: prefill chunks from an empty cache and over a cached
prefix, decodes whose key is the first or last slot of a block, over block tables that are a
shuffled slice of a pool whose spare blocks hold random data (reading a wrong block shows). The
pool has one size throughout and one backend serves each head layout, so the module compiles
two graphs (decodes, prefills) per layout; a cold inductor cache makes that most of its time.

What CUDA changes is checked here too, without a GPU: the tiles it runs (a decode padded to 16
tokens) against the reference on the CPU's kernel, the per-step index tensors' sizes, the
Triton tiles against inductor's rule, and the refusals for a T4, float64 or 8-token blocks. The
GPU-marked test runs the real thing.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from llm_runtime.attention import flex
from llm_runtime.attention.flex import FlexAttentionBackend, build_part, cuda_kernel_options
from llm_runtime.attention.metadata import AttentionMetadata
from llm_runtime.attention.selector import select_backend
from llm_runtime.attention.torch_gather import TorchGatherBackend
from torch._dynamo.utils import counters

DEVICE = torch.device("cpu")
CUDA = torch.device("cuda")
REASON = FlexAttentionBackend.is_available(DEVICE, torch.float32)
needs_cpu_flex = pytest.mark.skipif(REASON is not None, reason=f"flex attention cannot run here: {REASON}")

NUM_POOL_BLOCKS = 64  # one pool size for every batch: the compiled kernel is specialized on it
HEAD_DIM = 32
TOLERANCE = 1e-5  # float32 kernel against the float64 reference from the same inputs


@dataclass(frozen=True)
class Layout:
    num_heads: int
    num_kv_heads: int
    block_size: int


# GQA groups of 2 and 3; block size 16 (the engine's: a 16-token tile touches 2 blocks) and 8 (3 blocks).
LAYOUTS = [Layout(4, 2, 16), Layout(6, 2, 8)]


@dataclass
class Batch:
    query: torch.Tensor  # (N, H, d)
    key_pool: torch.Tensor  # (NUM_POOL_BLOCKS, block_size, KV, d)
    value_pool: torch.Tensor
    metadata: AttentionMetadata


def random_batch(layout: Layout, context_lens: list[int], query_lens: list[int], seed: int,
                 device: torch.device = DEVICE, dtype: torch.dtype = torch.float32) -> Batch:
    """Sequence b has context_lens[b] cached keys and query_lens[b] new tokens, in shuffled blocks."""
    gen = torch.Generator().manual_seed(seed)
    size = layout.block_size
    needed = [-(-(c + q) // size) for c, q in zip(context_lens, query_lens)]
    assert sum(needed) <= NUM_POOL_BLOCKS
    order = torch.randperm(NUM_POOL_BLOCKS, generator=gen).tolist()
    tables, used = [], 0
    for count in needed:
        tables.append(order[used : used + count])
        used += count
    shape = (NUM_POOL_BLOCKS, size, layout.num_kv_heads, HEAD_DIM)
    # The layout the model hands over: a transposed view of (H, N, d).
    query = torch.randn(layout.num_heads, sum(query_lens), HEAD_DIM, generator=gen).transpose(0, 1)
    metadata = AttentionMetadata.build(tables, context_lens, query_lens, block_size=size, device=device)
    key_pool, value_pool = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    return Batch(*(t.to(device, dtype) for t in (query, key_pool, value_pool)), metadata)


def reference(batch: Batch) -> torch.Tensor:
    backend = TorchGatherBackend()
    q, k, v = (t.double() for t in (batch.query, batch.key_pool, batch.value_pool))
    return backend.forward(q, None, None, k, v, backend.plan(batch.metadata))


def cpu_metadata(metadata: AttentionMetadata) -> AttentionMetadata:
    """The same step with its tensors on the CPU (the reference gathers there)."""
    return AttentionMetadata(metadata.block_size, *(t.cpu() for t in (metadata.query_start_loc, metadata.seq_lens,
                             metadata.block_tables, metadata.slot_mapping)), metadata.query_lens_host,
                             metadata.seq_lens_host, metadata.block_tables_host)


@pytest.fixture(scope="module", params=LAYOUTS, ids=lambda layout: f"gqa{layout.num_heads // layout.num_kv_heads}"
                f"-block{layout.block_size}")
def layout_and_backend(request: pytest.FixtureRequest) -> tuple[Layout, FlexAttentionBackend]:
    return request.param, FlexAttentionBackend()  # one backend per layout: its compiled graphs are reused


# (contexts, new tokens) per sequence. Prefills: 1 to 3 tiles, a chunk padded to a whole tile,
# chunks over a prefix that ends mid-block and at a block end; decodes: keys 1, 8, 9, 16, 17, 33.
BATCHES = {
    "mixed": ([0, 0, 16, 21, 7, 8, 15, 16, 32], [15, 33, 17, 12, 1, 1, 1, 1, 1]),
    "decodes": ([0, 7, 8, 15, 16, 31, 32, 100, 150], [1] * 9),
    "one-prefill-tile": ([5], [9]),
    "prefills-over-prefixes": ([40, 0, 63, 64], [40, 2, 3, 17]),
}


@needs_cpu_flex
@pytest.mark.parametrize("name", list(BATCHES))
def test_matches_reference(layout_and_backend: tuple[Layout, FlexAttentionBackend], name: str) -> None:
    layout, backend = layout_and_backend
    contexts, query_lens = BATCHES[name]
    batch = random_batch(layout, contexts, query_lens, seed=len(name))
    out = backend.forward(batch.query, None, None, batch.key_pool, batch.value_pool, backend.plan(batch.metadata))
    assert out.shape == batch.query.shape and out.dtype == batch.query.dtype
    error = (out.double() - reference(batch)).abs().max().item()
    assert error < TOLERANCE, f"max error {error}"


@needs_cpu_flex
def test_plan_is_reused_by_every_layer(layout_and_backend: tuple[Layout, FlexAttentionBackend]) -> None:
    """One plan, two layers (pools of different contents, queries too): each output is its own layer's."""
    layout, backend = layout_and_backend
    first = random_batch(layout, *BATCHES["mixed"], seed=1)
    plan = backend.plan(first.metadata)
    second = Batch(torch.randn_like(first.query), torch.randn_like(first.key_pool), torch.randn_like(first.value_pool),
                   first.metadata)
    for batch in (first, second):
        out = backend.forward(batch.query, None, None, batch.key_pool, batch.value_pool, plan)
        assert (out.double() - reference(batch)).abs().max().item() < TOLERANCE


@needs_cpu_flex
def test_new_step_shapes_do_not_recompile(layout_and_backend: tuple[Layout, FlexAttentionBackend]) -> None:
    layout, backend = layout_and_backend
    shapes = [([3, 50, 0], [1, 20, 33]), ([9, 0, 17, 4, 60], [1, 47, 5, 1, 1]), ([11, 12], [1, 30])]
    batches = [random_batch(layout, contexts, lens, seed=i) for i, (contexts, lens) in enumerate(shapes)]
    backend.forward(batches[0].query, None, None, batches[0].key_pool, batches[0].value_pool,
                    backend.plan(batches[0].metadata))  # compiles, if this layout has not yet
    graphs = counters["stats"]["unique_graphs"]
    for batch in batches[1:]:
        out = backend.forward(batch.query, None, None, batch.key_pool, batch.value_pool, backend.plan(batch.metadata))
        assert (out.double() - reference(batch)).abs().max().item() < TOLERANCE
    assert counters["stats"]["unique_graphs"] == graphs, "a step of new sizes compiled a new graph"


def test_availability_reasons() -> None:
    assert FlexAttentionBackend.is_available(DEVICE, torch.float64) is not None  # the CPU template has no float64
    assert FlexAttentionBackend.is_available(torch.device("meta"), torch.float32) is not None


def test_tile_sizes_are_validated() -> None:
    with pytest.raises(ValueError, match="prefill_tile_tokens"):
        FlexAttentionBackend(prefill_tile_tokens=0)


# --- what CUDA runs, checked on the CPU ---------------------------------------------------------------


@needs_cpu_flex
def test_cuda_tiles_match_reference() -> None:
    """The tiles CUDA runs (decodes padded to one 16-token tile, prefills in 16-token tiles) give the
    reference's output through the CPU's kernel: the padding and per-tile block lists CUDA reads are right."""
    layout = LAYOUTS[0]
    backend = FlexAttentionBackend(prefill_tile_tokens=flex.CUDA_TILE, decode_tile_tokens=flex.CUDA_TILE)
    for name in ("mixed", "decodes"):
        batch = random_batch(layout, *BATCHES[name], seed=7)
        plan = backend.plan(batch.metadata)
        assert plan.decodes is not None and plan.decodes.tile_tokens == flex.CUDA_TILE
        assert plan.decodes.rows.shape[0] == flex.CUDA_TILE * len(batch.metadata.decode_rows)  # one tile each
        out = backend.forward(batch.query, None, None, batch.key_pool, batch.value_pool, plan)
        assert (out.double() - reference(batch)).abs().max().item() < TOLERANCE


def test_index_tensors_are_sized_by_the_step_not_the_pool() -> None:
    """A step's block indices are (tiles, K) and (tiles, widest table): as large for a pool of a million blocks
    as for one of 64. Only the CPU's partial indices span the pool (its template asserts it)."""
    layout = LAYOUTS[0]
    batch = random_batch(layout, *BATCHES["mixed"], seed=3)
    metadata = batch.metadata
    part = build_part(metadata, metadata.decode_rows, flex.CUDA_TILE)
    num_tiles, width = part.tables.shape
    partial_width = part.partial_blocks.shape[1] - 1
    sizes = {}
    for num_pool_blocks in (NUM_POOL_BLOCKS, 1_000_000):
        partial, full = part.block_indices(num_pool_blocks, pool_wide=False)
        assert partial.shape == (num_tiles, partial_width) and full.shape == (num_tiles, max(2, width))
        assert partial.is_contiguous() and full.is_contiguous() and partial.data_ptr() != full.data_ptr()
        assert torch.equal(full[:, :width], part.tables)
        assert torch.equal(partial, part.partial_blocks[:, 1:].clamp(min=0))
        sizes[num_pool_blocks] = partial.nbytes + full.nbytes
    assert sizes[1_000_000] == sizes[NUM_POOL_BLOCKS] <= num_tiles * (partial_width + width + 2) * 4
    partial, full = part.block_indices(NUM_POOL_BLOCKS, pool_wide=True)  # what the CPU builds
    assert partial.shape == (num_tiles, NUM_POOL_BLOCKS) and full.shape == (num_tiles, max(2, width))
    assert torch.equal(partial[:, :partial_width], part.partial_blocks[:, 1:].clamp(min=0))
    assert not partial[:, partial_width:].any()


@pytest.mark.parametrize("group", range(1, 9))
@pytest.mark.parametrize("tile_tokens", [16, 32, 48])
def test_cuda_kernel_tiles_satisfy_inductors_rule(group: int, tile_tokens: int) -> None:
    """BLOCK_M divides the tile's rows and BLOCK_N every allowed pool block, both powers of two of at least
    16: what torch/_inductor/kernel/flex/flex_attention.py checks ("Q and KV block size must be divisible
    by BLOCK_M and BLOCK_N") and tl.dot needs."""
    options = cuda_kernel_options(tile_tokens * group)
    block_m, block_n = options["BLOCK_M"], options["BLOCK_N"]
    for block in (block_m, block_n):
        assert block >= 16 and block & (block - 1) == 0
    assert (tile_tokens * group) % block_m == 0 and block_m <= 64
    for block_size in (16, 32, 64, 256):
        assert FlexAttentionBackend.supports_block_size_on(CUDA, block_size) is None and block_size % block_n == 0
    assert options["FORCE_USE_FLEX_ATTENTION"] is True  # the main kernel, not the decoding one
    assert cuda_kernel_options(16 * 3)["BLOCK_M"] == 16 and cuda_kernel_options(16 * 4)["BLOCK_M"] == 64


def test_cuda_refusals_with_fake_capabilities(monkeypatch: pytest.MonkeyPatch) -> None:
    """What flex refuses on CUDA, asked with a pretend GPU: a T4, float64, blocks of 8, tiles of 24 tokens."""
    assert "8.0" in flex.cuda_unavailable_reason((7, 5), torch.bfloat16)
    assert "float64" in flex.cuda_unavailable_reason((9, 0), torch.float64)
    assert flex.cuda_unavailable_reason((8, 0), torch.float32) is None
    assert flex.cuda_unavailable_reason((9, 0), torch.bfloat16) is None
    assert "multiple of 16" in FlexAttentionBackend.supports_block_size_on(CUDA, 8)
    assert FlexAttentionBackend.supports_block_size_on(DEVICE, 8) is None  # the CPU's template takes any block
    assert FlexAttentionBackend().tile_tokens(CUDA) == (16, 16)
    assert FlexAttentionBackend().tile_tokens(DEVICE) == (16, 1)
    with pytest.raises(ValueError, match="multiple of 16 tokens"):
        FlexAttentionBackend(prefill_tile_tokens=24).tile_tokens(CUDA)
    # Through the selector, with Triton and a GPU pretended: named, flex runs or says why not.
    monkeypatch.setattr("torch.utils._triton.has_triton", lambda: True)
    for capability, block_size, error in [((9, 0), 8, "multiple of 16"), ((7, 5), 16, "8.0"), ((9, 0), 16, None)]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        if error is None:
            assert select_backend("flex", "cuda", torch.bfloat16, block_size=block_size).name == "flex"
        else:
            with pytest.raises(ValueError, match=error):
                select_backend("flex", "cuda", torch.bfloat16, block_size=block_size)
    assert select_backend("auto", "cuda", torch.bfloat16).name != "flex"  # never picked by itself


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference_on_the_gpu(dtype: torch.dtype) -> None:
    """On CUDA (Triton's kernel, compact indices, 16-token tiles): the reference's output on every batch, for
    GQA groups of 2 and 3; then steps of new sizes compile nothing new. (Inductor guards on a query of fewer
    than 128 rows, where it would pick its decoding kernel, so the new steps stay on the side of 128 rows
    the first batch compiled.)"""
    reason = FlexAttentionBackend.is_available(CUDA, dtype)
    if reason is not None:
        pytest.skip(reason)
    tolerance = 3e-2 if dtype == torch.bfloat16 else 2e-3

    def check(backend: FlexAttentionBackend, layout: Layout, contexts: list[int], query_lens: list[int],
              seed: int) -> None:
        batch = random_batch(layout, contexts, query_lens, seed=seed, device=CUDA, dtype=dtype)
        plan = backend.plan(batch.metadata)
        out = backend.forward(batch.query, None, None, batch.key_pool, batch.value_pool, plan)
        expected = reference(Batch(*(t.cpu() for t in (batch.query, batch.key_pool, batch.value_pool)),
                                   cpu_metadata(batch.metadata)))
        assert (out.cpu().double() - expected).abs().max().item() < tolerance

    for layout in (Layout(4, 2, 16), Layout(6, 2, 16)):
        backend = FlexAttentionBackend()
        for i, (contexts, query_lens) in enumerate(BATCHES.values()):
            check(backend, layout, contexts, query_lens, seed=i)
        check(backend, layout, *BATCHES["mixed"], seed=9)  # decodes and prefills of 128 rows or more
        graphs = counters["stats"]["unique_graphs"]
        for seed, shape in enumerate([([3, 50, 0, 9, 17, 4, 60], [1, 20, 33, 1, 1, 1, 1]),
                                      ([11, 12, 30, 31, 40], [1, 70, 1, 1, 1])]):
            check(backend, layout, *shape, seed=seed)
        assert counters["stats"]["unique_graphs"] == graphs, "a step of new sizes compiled a new graph"
