"""Tensor parallelism over NCCL, one GPU per rank (GPU-marked: skipped on machines with fewer than 2 GPUs, which
includes CI; NCCL refuses two ranks on one GPU). The same checks as the gloo tests: a tiny model's sharded
logits equal the whole model's, and the engine at 2 ranks gives one rank's greedy tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llm_runtime import LLM, SamplingParams
from llm_runtime.distributed.group import TensorParallelGroup
from llm_runtime.distributed.launch import run_on_ranks
from llm_runtime.model import load_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]
IDS = [[5, 17, 3, 42, 8, 11, 60, 96, 0, 50]]


def _logits_on_this_gpu(tp: TensorParallelGroup, folder: str) -> torch.Tensor | None:
    device = torch.device("cuda", torch.cuda.current_device())  # init_tensor_parallel set rank r's GPU r
    model = load_checkpoint(Path(folder), device=device, dtype=torch.float32, tensor_parallel=tp)
    with torch.inference_mode():
        logits = model.compute_logits(model(torch.tensor(IDS, device=device)))
    return logits.cpu() if tp.is_first else None


def test_nccl_shards_give_the_whole_models_logits(tiny_checkpoints) -> None:
    folder = tiny_checkpoints["qwen3"]
    sharded = run_on_ranks(_logits_on_this_gpu, 2, str(folder), device="cuda")[0]
    whole = load_checkpoint(folder, device=torch.device("cpu"), dtype=torch.float32)
    with torch.inference_mode():
        expected = whole.compute_logits(whole(torch.tensor(IDS)))
    assert (sharded - expected).abs().max().item() < 1e-4


def test_the_engine_on_two_gpus_gives_one_gpus_tokens(tiny_checkpoints) -> None:
    from llm_runtime.model.loader import load_model_weights

    folder = tiny_checkpoints["llama3"]
    prompts = [{"prompt_token_ids": ids} for ids in ([1, 2, 3, 4], [9, 8, 7], [5] * 12)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    results = []
    for size in (1, 2):
        model = load_model_weights(folder, device="cuda", dtype="float32")  # rank 0's; the workers load theirs
        with LLM.from_model(model, None, num_kv_blocks=64, tensor_parallel_size=size, enable_prefix_caching=True,
                            cuda_graphs=False) as llm:
            results.append(llm.generate(prompts, params, use_tqdm=False))
    for one, two in zip(*results, strict=True):
        assert two.outputs[0].token_ids == one.outputs[0].token_ids
        assert max(abs(a[t] - b[t]) for a, b, t in zip(one.outputs[0].logprobs, two.outputs[0].logprobs,
                                                         one.outputs[0].token_ids)) < 1e-4


def test_a_killed_worker_fails_a_two_gpu_engine_at_the_step_timeout(tiny_checkpoints) -> None:
    """Over NCCL a killed rank breaks nothing the others see (their kernels wait for its data): the group's watchdog
    aborts the communicator at tensor_parallel_timeout_s (TORCH_NCCL_ASYNC_ERROR_HANDLING=2, set by
    init_tensor_parallel), the step raises, and rank 0 finds the dead worker: EngineDeadError naming it, within
    the timeout and a margin, and no process left after shutdown (lesson 17, section 8)."""
    import os
    import signal
    import time

    from llm_runtime import EngineDeadError
    from llm_runtime.model.loader import load_model_weights

    model = load_model_weights(tiny_checkpoints["llama3"], device="cuda", dtype="float32")
    llm = LLM.from_model(model, None, num_kv_blocks=64, tensor_parallel_size=2, cuda_graphs=False,
                         tensor_parallel_timeout_s=5.0)
    engine = llm.llm_engine
    worker = engine.workers.processes[0]
    try:
        engine.add_request("a", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(temperature=0, max_tokens=400,
                                                                               ignore_eos=True))
        engine.step()
        os.kill(worker.pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(EngineDeadError):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - started < 5.0 + 30
        assert "exited" in repr(engine.dead_reason)
    finally:
        llm.shutdown()
    assert not [p for p in engine.workers.processes if p.is_alive()]
