"""The FlexAttention backend equals the torch-gather reference on mixed batches, without recompiling per step.

Every batch mixes the row kinds a step has: prefill chunks from an empty cache and over a cached
prefix, decodes whose key is the first or last slot of a block, over block tables that are a
shuffled slice of a pool whose spare blocks hold random data (reading a wrong block shows). The
pool has one size throughout and one backend serves each head layout, so the module compiles
two graphs (decodes, prefills) per layout; a cold inductor cache makes that most of its time.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from llm_runtime.attention.flex import FlexAttentionBackend
from llm_runtime.attention.metadata import AttentionMetadata
from llm_runtime.attention.torch_gather import TorchGatherBackend
from torch._dynamo.utils import counters

DEVICE = torch.device("cpu")
REASON = FlexAttentionBackend.is_available(DEVICE, torch.float32)
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"flex attention cannot run here: {REASON}")

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


def random_batch(layout: Layout, context_lens: list[int], query_lens: list[int], seed: int) -> Batch:
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
    metadata = AttentionMetadata.build(tables, context_lens, query_lens, block_size=size, device=DEVICE)
    return Batch(query, torch.randn(shape, generator=gen), torch.randn(shape, generator=gen), metadata)


def reference(batch: Batch) -> torch.Tensor:
    backend = TorchGatherBackend()
    q, k, v = (t.double() for t in (batch.query, batch.key_pool, batch.value_pool))
    return backend.forward(q, None, None, k, v, backend.plan(batch.metadata))


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


@pytest.mark.parametrize("name", list(BATCHES))
def test_matches_reference(layout_and_backend: tuple[Layout, FlexAttentionBackend], name: str) -> None:
    layout, backend = layout_and_backend
    contexts, query_lens = BATCHES[name]
    batch = random_batch(layout, contexts, query_lens, seed=len(name))
    out = backend.forward(batch.query, None, None, batch.key_pool, batch.value_pool, backend.plan(batch.metadata))
    assert out.shape == batch.query.shape and out.dtype == batch.query.dtype
    error = (out.double() - reference(batch)).abs().max().item()
    assert error < TOLERANCE, f"max error {error}"


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
