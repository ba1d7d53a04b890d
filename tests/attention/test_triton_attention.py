"""The Triton backend equals the torch-gather reference: unified and split-KV paths, the store kernel.

Without CUDA the kernels run on the CPU under Triton's interpreter, which must be switched on
before the kernel module is imported (Triton decides at decoration time); with CUDA they run on
the GPU. The shapes are small because the interpreter runs every program in NumPy, one by one.
The interpreter accepts some kernels the compiler rejects, so the kernels are also compiled for a
T4 and an H100 (no GPU needed for that).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

# tests/conftest.py switches Triton's interpreter on where there is no CUDA, before triton is imported.
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("TRITON_INTERPRET=1 must be set before triton is imported (tests/conftest.py does it)")

triton = pytest.importorskip("triton")

from llm_runtime.attention.backend import AttentionBackend, PagedAttentionStep
from llm_runtime.attention.kv_cache import PagedKVCache
from llm_runtime.attention.metadata import AttentionMetadata
from llm_runtime.attention.torch_gather import TorchGatherBackend
from llm_runtime.attention.triton_backend import TritonBackend

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BLOCK_SIZE = 16
# Largest |triton - reference| allowed, the reference computed in float64 from the same inputs.
# bfloat16: the output's own rounding (the interpreter truncates it) and, on the GPU, P rounded to bf16.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@dataclass
class Batch:
    query: torch.Tensor  # (N, H, d)
    key_pool: torch.Tensor  # (num_blocks, BLOCK_SIZE, KV, d)
    value_pool: torch.Tensor
    metadata: AttentionMetadata


def random_batch(
    context_lens: list[int],
    query_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    *,
    seed: int = 0,
    strided_query: bool = False,
) -> Batch:
    """Sequence b has context_lens[b] cached keys and query_lens[b] new tokens. The pools hold random
    data everywhere (spare blocks too: reading a wrong block shows), and each sequence's blocks are a
    random, out-of-order slice of the pool."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-(c + q) // BLOCK_SIZE) for c, q in zip(context_lens, query_lens)]
    num_blocks = sum(needed) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for count in needed:
        tables.append(order[used:used + count])
        used += count
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    key_pool = torch.randn(shape, generator=gen).to(dtype)
    value_pool = torch.randn(shape, generator=gen).to(dtype)
    num_tokens = sum(query_lens)
    if strided_query:  # the layout the model hands over: a transposed view of (H, N, d)
        query = torch.randn(num_heads, num_tokens, head_dim, generator=gen).to(dtype).transpose(0, 1)
    else:
        query = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    metadata = AttentionMetadata.build(tables, context_lens, query_lens, block_size=BLOCK_SIZE, device=DEVICE)
    return Batch(query.to(DEVICE), key_pool.to(DEVICE), value_pool.to(DEVICE), metadata)


def reference(batch: Batch) -> torch.Tensor:
    """torch-gather's output in float64 on the CPU, from the same (possibly rounded) inputs."""
    m = batch.metadata
    metadata = AttentionMetadata.build(m.block_tables_host, m.context_lens_host, m.query_lens_host,
                                       block_size=m.block_size, device="cpu")
    backend = TorchGatherBackend()
    q, k, v = (t.cpu().double() for t in (batch.query, batch.key_pool, batch.value_pool))
    return backend.forward(q, None, None, k, v, backend.plan(metadata))


def run_triton(batch: Batch, backend: TritonBackend) -> torch.Tensor:
    plan = backend.plan(batch.metadata)
    return backend.forward(batch.query, None, None, batch.key_pool, batch.value_pool, plan)


def assert_matches_reference(batch: Batch, backend: TritonBackend) -> None:
    out = run_triton(batch, backend)
    assert out.shape == batch.query.shape and out.dtype == batch.query.dtype
    error = (out.cpu().double() - reference(batch)).abs().max().item()
    assert error < TOLERANCE[batch.query.dtype], f"max error {error}"


# One step of every kind of row: prefill chunks from an empty cache at and around the block size,
# extends over a cached prefix (one crossing a block boundary), and decodes whose new key is the
# first, last, or first-after-the-last slot of a block, all in one batch.
MIXED_CONTEXTS = [0, 0, 0, 0, 16, 20, 15, 16, 31, 32]
MIXED_QUERIES = [15, 16, 17, 33, 17, 12, 1, 1, 1, 1]
# Decode-only batches for the split-KV path: 1 to 4 partitions of 32 keys.
DECODE_CONTEXTS = [0, 14, 15, 16, 31, 32, 63, 100]
GQA = [(2, 2), (6, 2), (4, 1), (8, 1)]  # (H, KV): groups of 1, 3, 4, 8 query heads per KV head


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", GQA, ids=[f"gqa{h // kv}" for h, kv in GQA])
def test_unified_kernel_mixed_batch(num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    batch = random_batch(MIXED_CONTEXTS, MIXED_QUERIES, num_heads, num_kv_heads, head_dim, strided_query=True)
    assert_matches_reference(batch, TritonBackend(split_kv="never"))


@pytest.mark.parametrize("length", [15, 16, 17, 32, 33])
def test_unified_kernel_lengths_around_block_boundaries(length: int) -> None:
    """A sequence of `length` keys as a prefill, as a decode, and as an extend of 5 tokens."""
    batch = random_batch([0, length - 1, length - 5], [length, 1, 5], 6, 2, 64, seed=length)
    assert_matches_reference(batch, TritonBackend(split_kv="never"))


@pytest.mark.parametrize("head_dim", [48, 80])
def test_unified_kernel_head_dim_not_a_power_of_two(head_dim: int) -> None:
    batch = random_batch([0, 20, 9], [19, 1, 4], 4, 2, head_dim)
    assert_matches_reference(batch, TritonBackend(split_kv="never"))


def test_unified_kernel_decodes_only() -> None:
    batch = random_batch(DECODE_CONTEXTS, [1] * len(DECODE_CONTEXTS), 6, 2, 64)
    assert_matches_reference(batch, TritonBackend(split_kv="never"))


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(2, 2, 64), (6, 2, 128), (4, 1, 64), (8, 1, 128)],
                         ids=["gqa1-d64", "gqa3-d128", "gqa4-d64", "gqa8-d128"])
def test_split_kv_decode(num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    batch = random_batch(DECODE_CONTEXTS, [1] * len(DECODE_CONTEXTS), num_heads, num_kv_heads, head_dim,
                         strided_query=True)
    backend = TritonBackend(split_kv="always", partition_size=32)
    assert backend.plan(batch.metadata).num_splits == 4  # 101 keys at most: 4 partitions of 32
    assert_matches_reference(batch, backend)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("split_kv", ["never", "always"], ids=["unified", "split"])
def test_half_precision(dtype: torch.dtype, split_kv: str) -> None:
    if split_kv == "always":
        batch = random_batch(DECODE_CONTEXTS, [1] * len(DECODE_CONTEXTS), 6, 2, 64, dtype)
    else:
        batch = random_batch(MIXED_CONTEXTS, MIXED_QUERIES, 6, 2, 64, dtype)
    assert_matches_reference(batch, TritonBackend(split_kv=split_kv, partition_size=32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_store_kv_writes_through_the_slot_mapping(dtype: torch.dtype) -> None:
    """The store kernel writes exactly what the base class's indexed copy writes; slot -1 writes nothing."""
    gen = torch.Generator().manual_seed(0)
    num_blocks, num_kv_heads, head_dim, num_tokens = 6, 3, 64, 20
    pools = [torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2)]
    # New keys as the model hands them over: transposed views of (KV, N, d).
    key = torch.randn(num_kv_heads, num_tokens, head_dim, generator=gen).to(dtype).transpose(0, 1)
    value = torch.randn(num_kv_heads, num_tokens, head_dim, generator=gen).to(dtype).transpose(0, 1)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen)[:num_tokens]
    slots[[3, 11, 19]] = -1
    expected = [p.clone() for p in pools]
    AttentionBackend.store_kv(TorchGatherBackend(), *expected, slots, key, value)
    key_pool, value_pool = (p.to(DEVICE, copy=True) for p in pools)
    TritonBackend().store_kv(key_pool, value_pool, slots.to(DEVICE), key.to(DEVICE), value.to(DEVICE))
    assert torch.equal(key_pool.cpu(), expected[0]) and torch.equal(value_pool.cpu(), expected[1])
    assert not torch.equal(expected[0], pools[0])  # the store did write something


def test_plan_chooses_the_path() -> None:
    decodes = random_batch([40, 70], [1, 1], 2, 1, 64).metadata
    mixed = random_batch([40, 0], [1, 5], 2, 1, 64).metadata
    assert TritonBackend(split_kv="always", partition_size=32).plan(decodes).num_splits == 3  # 71 keys
    assert TritonBackend(split_kv="always", partition_size=32).plan(mixed).num_splits == 0  # not decode-only
    assert TritonBackend(split_kv="never", partition_size=32).plan(decodes).num_splits == 0
    auto = TritonBackend(split_kv="auto", partition_size=32).plan(decodes).num_splits
    if DEVICE.type == "cpu":  # the interpreter has no multiprocessors to fill
        assert auto == 0
    else:  # 2 sequences are far fewer than any GPU's multiprocessors, and 71 keys span 3 partitions
        assert auto == 3


def test_constructor_validates() -> None:
    with pytest.raises(ValueError, match="split_kv"):
        TritonBackend(split_kv="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="partition_size"):
        TritonBackend(partition_size=48)


def test_is_available(monkeypatch: pytest.MonkeyPatch) -> None:
    assert TritonBackend.is_available(DEVICE, torch.float32) is None
    assert "float64" in TritonBackend.is_available(DEVICE, torch.float64)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "CUDA" in TritonBackend.is_available(torch.device("cpu"), torch.float32)


class _RecordingKernel:
    """Stands in for a Triton kernel: records whether each launch happens under a device guard, then launches."""

    def __init__(self, kernel, name: str, guards: list, launches: list) -> None:
        self.kernel, self.name, self.guards, self.launches = kernel, name, guards, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((self.name, list(self.guards)))
            return self.kernel[grid](*args, **kwargs)
        return launch


def test_every_launch_is_under_the_device_guard_of_its_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton launches on the current CUDA device, not on its tensors' one: for an engine on cuda:1 while cuda:0
    is current, a launch outside a guard runs on the wrong GPU. Every launch of every path is inside one, entered
    with the query's (or the new keys') device."""
    from llm_runtime.attention import triton_kernels

    guards: list[torch.device] = []  # the guards entered and not yet left
    launches: list[tuple[str, list[torch.device]]] = []

    @contextlib.contextmanager
    def recording_guard(tensor: torch.Tensor):
        guards.append(tensor.device)
        try:
            yield
        finally:
            guards.pop()

    monkeypatch.setattr(triton_kernels, "on_device", recording_guard, raising=False)
    for name in ("store_kv_kernel", "unified_attention_kernel", "split_kv_decode_kernel", "split_kv_reduce_kernel"):
        monkeypatch.setattr(triton_kernels, name, _RecordingKernel(getattr(triton_kernels, name), name, guards,
                                                                   launches))
    batch = random_batch([0, 20], [3, 1], 4, 2, 32)
    key = torch.zeros(batch.query.shape[0], 2, 32, device=DEVICE)
    TritonBackend().store_kv(batch.key_pool, batch.value_pool, batch.metadata.slot_mapping, key, key)
    run_triton(batch, TritonBackend(split_kv="never"))
    run_triton(random_batch([40, 70], [1, 1], 4, 2, 32), TritonBackend(split_kv="always", partition_size=32))
    assert [name for name, _ in launches] == ["store_kv_kernel", "unified_attention_kernel",
                                              "split_kv_decode_kernel", "split_kv_reduce_kernel"]
    assert all(entered == [DEVICE] for _, entered in launches), launches
    assert guards == []  # and left after


def test_the_guard_is_the_tensors_cuda_device_and_none_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from llm_runtime.attention import triton_launch

    entered: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "device", lambda device: entered.append(device) or contextlib.nullcontext())
    with triton_launch.on_device(SimpleNamespace(device=torch.device("cuda", 1))):
        pass
    assert entered == [torch.device("cuda", 1)]
    with triton_launch.on_device(torch.zeros(1)):  # the interpreter: no CUDA device to switch to
        pass
    assert entered == [torch.device("cuda", 1)]


def test_tensors_on_another_device_than_the_query_are_refused() -> None:
    from llm_runtime.attention import triton_kernels

    batch = random_batch([0, 20], [3, 1], 4, 2, 32)
    m = batch.metadata
    with pytest.raises(ValueError, match="device"):
        triton_kernels.unified_attention(batch.query, batch.key_pool, batch.value_pool, m.block_tables.to("meta"),
                                         m.seq_lens, m.query_start_loc, max_query_len=3, scale=1.0)
    with pytest.raises(ValueError, match="device"):
        triton_kernels.store_kv(batch.query[:, :2], batch.query[:, :2], batch.key_pool, batch.value_pool,
                                m.slot_mapping.to("meta"))


def test_end_to_end_through_paged_attention_step(tmp_path) -> None:
    """A tiny float32 model runs three steps (prefills, then an extend and a decode next to a new
    prefill) through PagedAttentionStep; Triton's hidden states equal torch-gather's."""
    from conftest import make_hf_model
    from llm_runtime.model import load_checkpoint

    make_hf_model("qwen3").save_pretrained(str(tmp_path))  # 4 heads, 2 KV heads, head_dim 32
    model = load_checkpoint(tmp_path, device=DEVICE, dtype=torch.float32)
    caches = {name: PagedKVCache.for_model(model.config, 12, BLOCK_SIZE, dtype=torch.float32, device=DEVICE)
              for name in ("gather", "triton")}
    backends = {"gather": TorchGatherBackend(), "triton": TritonBackend()}
    tables = [[7, 2], [4], [9, 0, 5]]
    gen = torch.Generator().manual_seed(1)
    steps = [([0, 0], [18, 5]), ([18, 5, 0], [1, 4, 33])]  # (starts, new tokens) of sequences 0.. per step
    with torch.no_grad():
        for starts, counts in steps:
            ids = torch.randint(3, 90, (1, sum(counts)), generator=gen).to(DEVICE)
            positions = torch.tensor([[p for s, c in zip(starts, counts) for p in range(s, s + c)]], device=DEVICE)
            hidden = {}
            for name, cache in caches.items():
                metadata = AttentionMetadata.build(tables[:len(starts)], starts, counts, block_size=BLOCK_SIZE,
                                                   device=DEVICE)
                step = PagedAttentionStep(cache, backends[name], metadata)
                hidden[name] = model(ids, step, positions)
            assert (hidden["triton"] - hidden["gather"]).abs().max().item() < 1e-4
    # Layer 0's keys and values are stored bit for bit; later layers' inherit attention's rounding.
    assert torch.equal(caches["triton"].keys[0], caches["gather"].keys[0])
    assert torch.equal(caches["triton"].values[0], caches["gather"].values[0])
    for layer in range(model.config.num_layers):
        assert (caches["triton"].keys[layer] - caches["gather"].keys[layer]).abs().max().item() < 1e-4
        assert (caches["triton"].values[layer] - caches["gather"].values[layer]).abs().max().item() < 1e-4


# Compiles (does not run) every kernel for a GPU target, as Triton would on that GPU: ptxas ships in the
# triton wheel, so this needs no GPU. The interpreter is lenient where the compiler is not (loop-carried
# types, dot shapes and dtypes), so CI checks both. Runs in a fresh process: under TRITON_INTERPRET=1
# the kernels in this one are interpreter objects.
_COMPILE_SCRIPT = """
import sys, torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from llm_runtime.attention import triton_kernels as tk

arch, dtype, d, per_kv = int(sys.argv[1]), getattr(torch, sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
types = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int32: "i32", torch.int64: "i64"}
bd, pool = max(16, triton.next_power_of_2(d)), dict(stride_pb=4096, stride_ps=256, stride_ph=d, stride_pd=1)
dots = dict(COMPUTE_FP32=False, DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32")
i32 = torch.int32
attention = dict(query_ptr=dtype, key_pool_ptr=dtype, value_pool_ptr=dtype, block_tables_ptr=i32, seq_lens_ptr=i32,
                 query_start_loc_ptr=i32, scale=0.1, stride_qt=1024, stride_qh=d, stride_qd=1, **pool, stride_bt=8,
                 BLOCK_SIZE=16, NUM_QUERIES_PER_KV=per_kv, BLOCK_N=32, HEAD_DIM=d, BLOCK_D=bd, **dots)
partials = dict(max_ptr=torch.float32, sum_ptr=torch.float32, acc_ptr=torch.float32)
launches = [
    (tk.store_kv_kernel, dict(key_ptr=dtype, value_ptr=dtype, key_pool_ptr=dtype, value_pool_ptr=dtype,
                              slot_mapping_ptr=torch.int64, stride_kt=256, stride_kh=d, stride_kd=1, stride_vt=256,
                              stride_vh=d, stride_vd=1, **pool, BLOCK_SIZE=16, NUM_KV_HEADS=2, HEAD_DIM=d,
                              BLOCK_H=2, BLOCK_D=bd)),
    (tk.unified_attention_kernel, dict(out_ptr=dtype, num_seqs=3, stride_ot=1024, stride_oh=d, stride_od=1,
                                       BLOCK_Q=64 // per_kv, BLOCK_M=64, **attention)),
    (tk.split_kv_decode_kernel, dict(**partials, NUM_SPLITS=4, PARTITION_SIZE=512, BLOCK_M=16, **attention)),
    (tk.split_kv_reduce_kernel, dict(out_ptr=dtype, **partials, seq_lens_ptr=i32, query_start_loc_ptr=i32,
                                     stride_ot=1024, stride_oh=d, stride_od=1, NUM_SPLITS=4, PARTITION_SIZE=512,
                                     BLOCK_S=4, HEAD_DIM=d, BLOCK_D=bd)),
]
for kernel, values in launches:
    signature, constexprs = {}, {}
    for param in kernel.params:
        value = values[param.name]
        if param.is_constexpr:
            signature[param.name], constexprs[param.name] = "constexpr", value
        elif isinstance(value, torch.dtype):
            signature[param.name] = "*" + types[value]
        else:
            signature[param.name] = "fp32" if isinstance(value, float) else "i32"
    compiled = triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", arch, 32))
    assert compiled.asm["cubin"], kernel.__name__
"""


@pytest.mark.parametrize("arch,dtype,head_dim,per_kv", [(75, "float16", 80, 3), (90, "bfloat16", 128, 8)],
                         ids=["t4-fp16", "h100-bf16"])
def test_kernels_compile_for_gpu_targets(tmp_path, arch: int, dtype: str, head_dim: int, per_kv: int) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT, str(arch), dtype, str(head_dim), str(per_kv)],
                            check=False, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_gpu_larger_shapes(dtype: torch.dtype) -> None:
    """Compiled kernels on the GPU, on longer contexts than the interpreter can afford: both paths."""
    contexts, queries = [0, 0, 300, 1000, 2047, 15, 511], [200, 37, 64, 1, 1, 1, 1]
    batch = random_batch(contexts, queries, 32, 8, 128, dtype)
    assert_matches_reference(batch, TritonBackend(split_kv="never"))
    decodes = random_batch([2047, 1000, 5, 4000], [1, 1, 1, 1], 32, 8, 128, dtype)
    assert_matches_reference(decodes, TritonBackend(split_kv="always", partition_size=512))
    assert_matches_reference(decodes, TritonBackend(split_kv="auto", partition_size=512))


def _on(batch: Batch, device: torch.device) -> Batch:
    """The same batch with every tensor, the metadata's too, on `device`."""
    m = batch.metadata
    metadata = AttentionMetadata.build(m.block_tables_host, m.context_lens_host, m.query_lens_host,
                                       block_size=m.block_size, device=device)
    return Batch(batch.query.to(device), batch.key_pool.to(device), batch.value_pool.to(device), metadata)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_gpu_tensors_on_the_second_device_are_attended_there_while_the_first_is_current() -> None:
    """An engine on cuda:1: the kernels run there (right answers, no illegal address) with cuda:0 current."""
    second = torch.device("cuda", 1)
    mixed = _on(random_batch(MIXED_CONTEXTS, MIXED_QUERIES, 6, 2, 64), second)
    decodes = _on(random_batch(DECODE_CONTEXTS, [1] * len(DECODE_CONTEXTS), 6, 2, 64), second)
    with torch.cuda.device(0):
        assert_matches_reference(mixed, TritonBackend(split_kv="never"))
        assert_matches_reference(decodes, TritonBackend(split_kv="always", partition_size=32))
        key_pool = torch.zeros_like(mixed.key_pool)
        new = torch.randn(mixed.query.shape[0], 2, 64, device=second)
        TritonBackend().store_kv(key_pool, key_pool.clone(), mixed.metadata.slot_mapping, new, new)
        torch.cuda.synchronize(second)
        assert torch.cuda.current_device() == 0
    stored = key_pool.view(-1, 2, 64)[mixed.metadata.slot_mapping]
    assert torch.equal(stored, new)
