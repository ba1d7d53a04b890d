"""The `vllm-cpu` runner's worker: serve one workload with vLLM's engine and write each token's time.

`VLLMRunner` runs this file by path with vLLM's own Python (`make vllm-env` builds `.venv-vllm`), because
vLLM pins a torch of its own: so it imports vLLM and the standard library only, never `llm_runtime`.

    .venv-vllm/bin/python vllm_worker.py JOB.json RESULT.json

JOB.json:    {"model": folder, "dtype": "float32", "engine_args": {EngineArgs fields}, "warmup": true,
              "requests": [{"prompt_token_ids": [...], "max_tokens": n, "arrival_time": seconds}, ...]}
RESULT.json: {"vllm_version": str, "startup_seconds": s, "duration": s, "engine_args": {resolved},
              "requests": [{"token_ids": [...], "token_times": [...]}, ...]}  (in JOB's order)

Every request is greedy, of exactly `max_tokens` tokens (EOS ignored), as in every runner. The clock starts
when the first request is added (engine build and warm-up are not timed); arrival times and token times
are seconds on that clock. A request enters the engine when its arrival time has come, and each token's
time is when the engine step that made it returns, as in this package's `EngineRunner`.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any


def _greedy(max_tokens: int) -> Any:
    """Greedy, a fixed length, new tokens only at each step, ids only (the other runners detokenize nothing)."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                          output_kind=RequestOutputKind.DELTA)


def build_engine(model: str, dtype: str, engine_args: dict[str, Any]) -> Any:
    """vLLM's `LLMEngine` with the defaults `vllm.LLM` would pick (its usage context), plus `engine_args`."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.llm_engine import LLMEngine

    args = EngineArgs(model=model, dtype=dtype, seed=0, disable_log_stats=True, **engine_args)
    return LLMEngine.from_engine_args(args, usage_context=UsageContext.LLM_CLASS)


def warm_up(engine: Any) -> None:
    """One short request through every path (prefill, decode, sampling), then an empty prefix cache."""
    engine.add_request("warmup", {"prompt_token_ids": list(range(1000, 1040))}, _greedy(4))
    while engine.has_unfinished_requests():
        engine.step()
    engine.reset_prefix_cache()


def serve(engine: Any, requests: list[dict[str, Any]]) -> tuple[list[list[int]], list[list[float]], float]:
    """Each request's output tokens and token times, and the run's duration (seconds from the first add)."""
    pending = sorted(range(len(requests)), key=lambda i: requests[i]["arrival_time"])
    tokens: list[list[int]] = [[] for _ in requests]
    times: list[list[float]] = [[] for _ in requests]
    index: dict[str, int] = {}
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while pending and requests[pending[0]]["arrival_time"] <= now:
            i = pending.pop(0)
            index[f"bench-{i}"] = i
            engine.add_request(f"bench-{i}", {"prompt_token_ids": requests[i]["prompt_token_ids"]},
                               _greedy(requests[i]["max_tokens"]))
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, requests[pending[0]]["arrival_time"] - now))
            continue
        for output in engine.step():
            new = list(output.outputs[0].token_ids)
            when = time.perf_counter() - start
            i = index[output.request_id]
            tokens[i] += new
            times[i] += [when] * len(new)
    return tokens, times, time.perf_counter() - start


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(f"usage: {argv[0]} JOB.json RESULT.json", file=sys.stderr)
        return 2
    job = json.loads(Path(argv[1]).read_text())
    begin = time.perf_counter()
    import vllm

    engine = build_engine(job["model"], job["dtype"], job.get("engine_args", {}))
    if job.get("warmup", True):
        warm_up(engine)
    startup = time.perf_counter() - begin
    print(f"vllm_worker: engine ready in {startup:.1f} s; serving {len(job['requests'])} requests",
          file=sys.stderr, flush=True)
    tokens, times, duration = serve(engine, job["requests"])
    config = engine.vllm_config
    resolved = {"max_num_seqs": config.scheduler_config.max_num_seqs,
                "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
                "block_size": config.cache_config.block_size,
                "num_kv_blocks": config.cache_config.num_gpu_blocks,
                "kv_cache_memory_bytes": config.cache_config.kv_cache_memory_bytes,
                "enable_prefix_caching": config.cache_config.enable_prefix_caching,
                "compilation_mode": str(config.compilation_config.mode),
                "dtype": str(config.model_config.dtype)}
    result = {"vllm_version": vllm.__version__, "startup_seconds": startup, "duration": duration,
              "engine_args": resolved,
              "requests": [{"token_ids": t, "token_times": s} for t, s in zip(tokens, times)]}
    Path(argv[2]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
