"""Decode steps from CUDA graphs: the buckets, when graphs are used or refused, and the same tokens.

On the CPU, `DecodeGraphs(replay="eager")` runs the captured step function itself (static buffers,
padded rows, the plan made once for `max_model_len`) with the Triton kernels under Triton's
interpreter: everything a graph replays but the graph. The GPU-marked tests capture real graphs.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from llm_runtime import EngineConfig, LLMEngine, SamplingParams
from llm_runtime.attention import PagedKVCache, available_backends
from llm_runtime.attention.blockwise import BlockwiseBackend
from llm_runtime.attention.triton_backend import TritonBackend
from llm_runtime.config import ModelConfig
from llm_runtime.worker.cuda_graphs import (DecodeGraphs, graph_batch_sizes, graph_memory, graph_memory_bytes,
                                            graphs_unavailable_reason)
from llm_runtime.model import CausalLM

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(available_backends(DEVICE, torch.float32)["triton"] is not None,
                                  reason="the triton backend cannot run here")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_buckets() -> None:
    assert graph_batch_sizes(1) == (1,)
    assert graph_batch_sizes(3) == (1, 2, 3)
    assert graph_batch_sizes(16) == (1, 2, 4, 8, 16)
    assert graph_batch_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert graph_batch_sizes(256) == (1, 2, 4, 8, *range(16, 257, 16))
    with pytest.raises(ValueError):
        graph_batch_sizes(0)


def test_graphs_are_refused_where_they_cannot_run(tiny_pairs) -> None:
    model, _ = tiny_pairs["llama3"]
    assert "CUDA device" in graphs_unavailable_reason(torch.device("cpu"), TritonBackend())
    assert "cannot be captured" in graphs_unavailable_reason(torch.device("cuda"), BlockwiseBackend())
    with pytest.raises(ValueError, match="cuda_graphs=True, but CUDA graphs need a CUDA device"):
        LLMEngine(model, None, EngineConfig(cuda_graphs=True))
    with pytest.raises(ValueError, match="enforce_eager"):
        EngineConfig(cuda_graphs=True, enforce_eager=True)
    with pytest.raises(ValueError, match="cuda_graphs"):
        EngineConfig(cuda_graphs="yes")
    # The CPU's default: no graphs.
    stats = LLMEngine(model, None, EngineConfig()).stats()
    assert stats.cuda_graph_sizes == () and stats.num_graph_replays == 0


def _run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, arrive_every: int = 2) -> dict:
    """Add a request every `arrive_every` steps, so decode batches take every size on the way."""
    pending, finished, step = list(enumerate(prompts)), {}, 0
    while pending or engine.has_unfinished_requests():
        if pending and step % arrive_every == 0:
            i, prompt = pending.pop(0)
            engine.add_request(str(i), prompt, params)
        finished.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        step += 1
    return finished


def _prompts(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    lengths = [5, 17, 3, 30, 9, 21, 2]
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in lengths]


@needs_triton
@pytest.mark.parametrize("split_kv", ["never", "always"])
def test_replayed_decode_steps_give_the_eager_tokens(tiny_pairs, split_kv: str) -> None:
    """Decodes replayed through the bucketed step function (n of 7 sequences padded to buckets 1, 2, 4, 8)
    give the eager engine's greedy tokens, with the unified kernel and with split-KV (whose number of
    partitions the kept plan fixes from max_model_len, most of them empty)."""
    model = copy.deepcopy(tiny_pairs["qwen3"][0]).float()
    prompts = _prompts(model.config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=64, block_size=4,
                          max_model_len=80, attention_backend="triton")
    expected = _run(LLMEngine(model, None, config), prompts, params)

    engine = LLMEngine(model, None, config)
    backend = TritonBackend(split_kv=split_kv, partition_size=32)
    engine.model_runner.attention_backend = backend
    graphs = DecodeGraphs(model, engine.kv_cache, backend, max_num_seqs=8, max_model_len=engine.max_model_len,
                          replay="eager")
    engine.model_runner.capture_graphs(graphs)
    assert graphs.sizes == (1, 2, 4, 8)
    returned = _record_returned_logits(graphs)
    assert _run(engine, prompts, params) == expected
    assert engine.stats().num_graph_replays > 10
    # Every bucket's logits are rows of the one static output: nothing per bucket is kept.
    assert {graphs.bucket_for(rows) for _, rows in returned} == set(graphs.sizes)  # every bucket replayed
    assert {pointer for pointer, _ in returned} == {graphs.logits.data_ptr()}
    estimate = graph_memory(model.config, backend, max_num_seqs=8, max_model_len=engine.max_model_len,
                            dtype=model.dtype, block_size=engine.kv_cache.block_size)
    assert graphs.static_bytes() == estimate.static_logits + estimate.static_inputs


def _record_returned_logits(graphs: DecodeGraphs) -> list[tuple[int, int]]:
    """Wrap graphs.run to note (storage address, rows) of each logits tensor it returns."""
    returned, run = [], graphs.run

    def recording_run(model_input):
        logits = run(model_input)
        returned.append((logits.untyped_storage().data_ptr(), logits.shape[0]))
        return logits

    graphs.run = recording_run
    return returned


def test_graph_memory_counts_what_the_graphs_hold() -> None:
    """At 256 sequences and a 152k vocabulary (Qwen2.5-7B's shape, bfloat16): the reserve covers the static
    output (256 rows of logits), the pool's copy of the largest bucket's logits and its intermediates, the
    backend's workspace and the static inputs. A graph per bucket keeping its own logits would have held
    1 + 2 + 4 + 8 + 16 + ... + 256 = 2191 rows, 666 MB, against this reserve of a third of that."""
    config = ModelConfig(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                         num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128, max_position_embeddings=32768)
    backend = TritonBackend(split_kv="always", partition_size=512)
    memory = graph_memory(config, backend, max_num_seqs=256, max_model_len=4096, dtype=torch.bfloat16)
    one_copy = 256 * 152064 * 2  # (256, vocab) bfloat16: 77.9 MB
    assert memory.static_logits == memory.pool_logits == one_copy
    assert memory.workspace == backend.decode_workspace_bytes(256, 4096, 28, 128) > 0
    assert memory.static_inputs >= 256 * (4096 // 16) * 4  # the block tables
    per_row = 6 * 3584 + 3 * 18944 + (28 + 2 * 4) * 128
    assert memory.activations == 256 * per_row * 2
    held = 2 * one_copy + memory.activations + memory.workspace + memory.static_inputs
    assert graph_memory_bytes(config, backend, max_num_seqs=256, max_model_len=4096, dtype=torch.bfloat16) == \
        memory.total >= held
    per_bucket = sum(graph_batch_sizes(256)) * 152064 * 2
    assert sum(graph_batch_sizes(256)) == 2191 and per_bucket > 665e6 and memory.total < per_bucket / 2


@needs_triton
def test_padded_rows_write_nowhere(tiny_pairs) -> None:
    """A step of 3 decodes replayed in the bucket of 4 writes exactly its 3 new slots of the pool."""
    model = copy.deepcopy(tiny_pairs["qwen3"][0]).float()
    engine = LLMEngine(model, None, EngineConfig(max_num_seqs=4, num_kv_blocks=32, block_size=4, max_model_len=64,
                                                 attention_backend="triton"))
    graphs = DecodeGraphs(model, engine.kv_cache, engine.attention_backend, max_num_seqs=4,
                          max_model_len=engine.max_model_len, replay="eager")
    engine.model_runner.capture_graphs(graphs)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for i, prompt in enumerate(_prompts(model.config.vocab_size)[:3]):
        engine.add_request(str(i), prompt, params)
    engine.step()  # the three prefills, eagerly
    assert engine.stats().num_graph_replays == 0
    graphs.slot_mapping.fill_(0)  # what an earlier, larger step could have left in the padded rows
    before = [pool.clone() for pool in engine.kv_cache.keys]
    lengths = {seq: seq.num_tokens for seq in engine.scheduler.running}  # the decode writes position n - 1
    engine.step()  # three decodes, in the bucket of 4
    assert engine.stats().num_graph_replays == 1
    block_size, tables = engine.kv_cache.block_size, engine.block_manager.block_tables
    expected = {tables[seq][(n - 1) // block_size] * block_size + (n - 1) % block_size for seq, n in lengths.items()}
    for old, new in zip(before, engine.kv_cache.keys):
        changed = (old != new).flatten(2).any(-1).flatten().nonzero()[:, 0].tolist()  # flat slots written
        assert set(changed) == expected


@needs_cuda
@pytest.mark.parametrize("compile_pointwise", [False, True])
def test_cuda_graphs_give_the_eager_tokens_on_the_gpu(tiny_pairs, compile_pointwise: bool) -> None:
    """On CUDA, graphs are captured by default (Triton backend), and give the same engine's greedy tokens
    without graphs (same pointwise ops, float32: only the graph differs)."""
    model = copy.deepcopy(tiny_pairs["qwen3"][0]).to("cuda", torch.float32)
    prompts = _prompts(model.config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    base = dict(max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=256, attention_backend="triton",
                compile_pointwise=compile_pointwise)
    expected = _run(LLMEngine(model, None, EngineConfig(**base, cuda_graphs=False)), prompts, params)
    engine = LLMEngine(model, None, EngineConfig(**base))
    assert engine.stats().cuda_graph_sizes == (1, 2, 4, 8)
    assert _run(engine, prompts, params) == expected
    assert engine.stats().num_graph_replays > 10
    engine.shutdown()
    assert engine.model_runner.graphs is None


@needs_cuda
@pytest.mark.parametrize("split_kv", ["never", "always"])
def test_captured_split_kv_gives_the_eager_tokens_on_the_gpu(tiny_pairs, split_kv: str) -> None:
    """Real graphs over both decode kernels, split-KV with small partitions (most of them empty at replay)."""
    model = copy.deepcopy(tiny_pairs["qwen3"][0]).to("cuda", torch.float32)
    prompts = _prompts(model.config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=64, block_size=16,
                          max_model_len=256, attention_backend="triton", cuda_graphs=False)
    backend = TritonBackend(split_kv=split_kv, partition_size=32)
    eager = LLMEngine(model, None, config)
    eager.model_runner.attention_backend = backend
    expected = _run(eager, prompts, params)
    engine = LLMEngine(model, None, config)
    engine.model_runner.attention_backend = backend
    graphs = DecodeGraphs(model, engine.kv_cache, backend, max_num_seqs=8, max_model_len=engine.max_model_len)
    engine.model_runner.capture_graphs(graphs)
    assert _run(engine, prompts, params) == expected
    assert engine.stats().num_graph_replays > 10


def test_graph_memory_is_kept_out_of_the_pool_and_a_failed_capture_falls_back(tiny_pairs, monkeypatch) -> None:
    """When graphs will be captured, the KV budget keeps room for their pool; when a capture the config did
    not insist on fails, the engine warns and runs every step eagerly (here on the CPU, with the CUDA
    checks patched out and a capture that raises)."""
    from llm_runtime.worker import plan as plan_module
    from llm_runtime.worker.cuda_graphs import graph_memory_bytes

    from llm_runtime.worker.kv_budget import CPU_DEVICE

    model = tiny_pairs["llama3"][0]
    others = CPU_DEVICE.held_bytes(torch.device("cpu"))  # engines other tests left alive (test_kv_memory's _others)
    config = EngineConfig(max_num_seqs=16, max_model_len=256, cpu_device_memory=8 * 2**20 + int(others / 0.9),
                          block_size=16)
    plain = LLMEngine(model, None, config)
    plain_blocks = plain.stats().num_total_blocks
    backend = plain.attention_backend
    plain.shutdown()

    def failing_capture(self) -> None:
        raise RuntimeError("operation not permitted when stream is capturing")

    from llm_runtime.worker import cuda_graphs

    for module in (plan_module, cuda_graphs):
        monkeypatch.setattr(module, "graphs_unavailable_reason", lambda device, backend: None)
    monkeypatch.setattr(DecodeGraphs, "capture", failing_capture)
    with pytest.warns(RuntimeWarning, match="every step runs eagerly"):
        engine = LLMEngine(model, None, config)
    reserve = graph_memory_bytes(model.config, backend, max_num_seqs=16, max_model_len=256, dtype=model.dtype)
    block_bytes = engine.kv_cache.nbytes // engine.stats().num_total_blocks
    assert reserve > block_bytes
    assert engine.stats().num_total_blocks == plain_blocks - reserve // block_bytes or \
        engine.stats().num_total_blocks == plain_blocks - reserve // block_bytes - 1
    assert engine.model_runner.graphs is None and engine.stats().cuda_graph_sizes == ()
    engine.add_request("a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    engine.shutdown()
    with pytest.raises(RuntimeError, match="stream is capturing"):
        LLMEngine(model, None, replace(config, cuda_graphs=True))


@needs_cuda
@pytest.mark.gpu
def test_captured_graphs_hold_what_the_reserve_counts() -> None:
    """Real graphs, 128 buckets' worth of sequences over a 64k vocabulary: the private pool's segments hold no
    more than the estimate's pool share (plus the caching allocator's rounding: its 2 and 20 MiB segments),
    and the static buffers are exactly the estimate's. Every bucket keeping its own logits would put
    591 rows of 256 KiB, 148 MiB, in the pool."""
    config = ModelConfig(model_type="llama", vocab_size=65536, hidden_size=64, intermediate_size=128, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=512)
    torch.manual_seed(0)
    model = CausalLM(config).to("cuda", torch.float32).eval()
    cache = PagedKVCache.for_model(config, 64, 16, dtype=torch.float32, device=model.device)
    backend = TritonBackend(split_kv="never")
    graphs = DecodeGraphs(model, cache, backend, max_num_seqs=128, max_model_len=256)
    with torch.inference_mode():
        graphs.capture()
    torch.cuda.synchronize()
    pool_bytes = sum(segment["total_size"] for segment in torch.cuda.memory_snapshot()
                     if tuple(segment.get("segment_pool_id", ())) == tuple(graphs.pool))
    estimate = graph_memory(config, backend, max_num_seqs=128, max_model_len=256, dtype=torch.float32)
    assert 0 < pool_bytes <= estimate.activations + estimate.pool_logits + estimate.workspace + 24 * 2**20
    assert graphs.static_bytes() == estimate.static_logits + estimate.static_inputs
    graphs.close()
