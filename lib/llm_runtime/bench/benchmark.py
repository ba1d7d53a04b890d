"""Benchmarks: seeded workloads, runners that serve them, and a side-by-side report.

Workloads are lists of requests (prompt token ids, output length, arrival time). Every runner
serves the same workload greedily with EOS ignored, so every runner does the same work:
- `EngineRunner`: this package's `LLM`, continuous batching on the paged pool;
- `HFStaticRunner`: transformers `generate` on FCFS batches of a fixed size, left-padded;
- `HFContinuousRunner`: transformers' own continuous batching (`ContinuousBatchingManager`).
Arrival times of 0 make an offline run (everything queued at once); Poisson arrivals make an
online run, in which each request enters its runner when its time comes.

`run_benchmark` first runs a few requests through every runner and refuses to go on if their
tokens differ (a faster runner that computes something else proves nothing), then times each one.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import torch
from tqdm.auto import tqdm

from ..config import EngineConfig, ModelConfig
from ..engine.engine import LLMEngine
from ..engine.llm import LLM
from ..engine.outputs import RequestOutput
from ..model import CausalLM
from ..sampling import RequestOutputKind, SamplingParams
from .metrics import BenchmarkMetrics, LatencyTargets, RequestTiming, summarize
from .roofline import MachinePeaks, request_flops


# ---------------------------------------------------------------------------------------- workloads
@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_time: float = 0.0  # seconds after the run starts


@dataclass(frozen=True)
class Workload:
    name: str
    requests: list[BenchRequest]

    @property
    def is_online(self) -> bool:
        return any(r.arrival_time > 0 for r in self.requests)

    def head(self, num_requests: int, max_tokens: int | None = None) -> "Workload":
        """The first requests, arriving at once (optionally with shorter outputs): for output checks."""
        requests = [replace(r, arrival_time=0.0, max_tokens=min(r.max_tokens, max_tokens or r.max_tokens))
                    for r in self.requests[:num_requests]]
        return Workload(f"{self.name} (first {len(requests)})", requests)


def _random_tokens(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    low = min(100, vocab_size // 4)  # skip the first ids, where tokenizers keep their special tokens
    return [rng.randrange(low, min(vocab_size, 10_000)) for _ in range(length)]


def fixed_workload(num_requests: int, input_len: int, output_len: int, *, vocab_size: int, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    return Workload(f"fixed {input_len} in / {output_len} out",
                    [BenchRequest(_random_tokens(rng, input_len, vocab_size), output_len) for _ in range(num_requests)])


def uniform_workload(num_requests: int = 256, min_len: int = 100, max_len: int = 1024, *, scale: int = 1,
                     vocab_size: int, seed: int = 0) -> Workload:
    """nano-vllm's benchmark: input and output lengths uniform in [min_len, max_len], divided by `scale`."""
    rng = random.Random(seed)
    low, high = max(1, min_len // scale), max(1, max_len // scale)
    requests = [BenchRequest(_random_tokens(rng, rng.randint(low, high), vocab_size), rng.randint(low, high))
                for _ in range(num_requests)]
    return Workload(f"uniform {low}-{high} in and out", requests)


def shared_prefix_workload(num_requests: int, prefix_len: int, suffix_len: int, output_len: int, *,
                           vocab_size: int, seed: int = 0) -> Workload:
    """One long system prompt shared by every request, then a short request-specific part."""
    rng = random.Random(seed)
    prefix = _random_tokens(rng, prefix_len, vocab_size)
    requests = [BenchRequest(prefix + _random_tokens(rng, suffix_len, vocab_size), output_len)
                for _ in range(num_requests)]
    return Workload(f"shared prefix {prefix_len} + {suffix_len} in / {output_len} out", requests)


def with_poisson_arrivals(workload: Workload, rate: float, seed: int = 0) -> Workload:
    """Requests arrive as a Poisson process of `rate` requests per second (exponential gaps)."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    rng = random.Random(seed)
    now, requests = 0.0, []
    for request in workload.requests:
        requests.append(replace(request, arrival_time=now))
        now += rng.expovariate(rate)
    return Workload(f"{workload.name}, Poisson {rate:g} req/s", requests)


# ------------------------------------------------------------------------------------------ runners
@dataclass
class RunResult:
    runner: str
    outputs: list[list[int]]
    timings: list[RequestTiming]
    duration: float
    info: dict = field(default_factory=dict)


class Runner(Protocol):
    """A way to serve a workload. One may say `exact = False` (another engine, whose kernels round otherwise: its
    tokens are compared with the others', not required to equal them)."""

    name: str

    def run(self, workload: Workload, progress: bool = False) -> RunResult: ...


def _greedy(max_tokens: int) -> SamplingParams:
    """Greedy, a fixed length; one output per request, at its end (no per-step copies)."""
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                          output_kind=RequestOutputKind.FINAL_ONLY)


class EngineRunner:
    """This package's engine: requests enter `LLMEngine` at their arrival times; one step at a time.

    Each run gets a fresh engine (`engine_options` are EngineConfig fields), so no run finds the
    previous one's blocks in its prefix cache; it is shut down when the run ends. `owns_model`: the model
    was loaded for these engines alone (the bench command's), so they treat it as `LLM(...)` treats its own
    (packed in place, the forward pass compiled where that applies; `LLM.from_model`).
    """

    def __init__(self, model: CausalLM, name: str = "llm_runtime", *, owns_model: bool = False,
                 quantization: str | None = None, **engine_options: object) -> None:
        self.model = model
        self.owns_model = owns_model
        self.quantization = quantization  # how `model` was loaded: a tensor-parallel run loads its shards so
        self.engine_options = engine_options
        self.name = name

    def _engine(self) -> LLMEngine:
        """A fresh engine for one run. With tensor_parallel_size > 1 every rank loads its shard anew (the model
        given stays whole for the other runs), by the model's name, as `load_model` loaded it."""
        if int(self.engine_options.get("tensor_parallel_size", 1)) > 1:  # type: ignore[call-overload]
            if self.model.source is None:
                raise ValueError("a tensor-parallel run loads the model by its name; this model has none")
            return LLMEngine.from_pretrained(self.model.source or None, device=self.model.device,
                                             dtype=self.model.dtype, quantization=self.quantization,
                                             config=EngineConfig(**self.engine_options))  # type: ignore[arg-type]
        return LLM.from_model(self.model, None, owns_model=self.owns_model, **self.engine_options).llm_engine

    def run(self, workload: Workload, progress: bool = False) -> RunResult:
        engine = self._engine()
        pending = sorted(range(len(workload.requests)), key=lambda i: workload.requests[i].arrival_time)
        finished: dict[int, RequestOutput] = {}
        bar = tqdm(total=len(pending), desc=self.name, unit="req", disable=not progress, leave=False)
        start = time.perf_counter()
        while pending or engine.has_unfinished_requests():
            now = time.perf_counter() - start
            while pending and workload.requests[pending[0]].arrival_time <= now:
                i = pending.pop(0)
                request = workload.requests[i]
                engine.add_request(f"bench-{i}", {"prompt_token_ids": request.prompt_token_ids},
                                   _greedy(request.max_tokens), arrival_time=start + request.arrival_time)
            if not engine.has_unfinished_requests():
                time.sleep(max(0.0, workload.requests[pending[0]].arrival_time - now))
                continue
            for output in engine.step():
                if output.finished:
                    finished[int(output.request_id.removeprefix("bench-"))] = output
                    bar.update(1)
        duration = time.perf_counter() - start
        bar.close()
        profile = engine.profile
        info = {"stats": vars(engine.stats()), "step_profile": {
            **vars(profile), **{f"{phase}_fraction": value for phase, value in profile.fractions().items()}}}
        engine.shutdown()  # the next runner (transformers, on a GPU) gets the pool's memory back
        return _collect(self.name, workload, start, duration, {
            i: (o.outputs[0].token_ids, o.metrics.token_times) for i, o in finished.items()}, info)


def _collect(runner: str, workload: Workload, start: float, duration: float,
             finished: dict[int, tuple[Sequence[int], Sequence[float]]], info: dict | None = None) -> RunResult:
    """A run's result from each request's (output tokens, token times), in workload order."""
    outputs, timings = [], []
    for i, request in enumerate(workload.requests):
        tokens, times = finished[i]
        outputs.append(list(tokens))
        timings.append(RequestTiming(start + request.arrival_time, tuple(times), len(request.prompt_token_ids)))
    return RunResult(runner, outputs, timings, duration, info or {})


def log_tail(path: Path, offset: int, lines: int = 30) -> str:
    """The last `lines` lines written to the log at `path` after byte `offset` (one run's part of a log that a
    runner's subprocess appends to), for an error message."""
    try:
        with path.open("rb") as log:
            log.seek(offset)
            text = log.read().decode(errors="replace")
    except OSError as error:
        return f"(could not read it: {error})"
    return "\n".join(text.rstrip().splitlines()[-lines:]) or "(nothing)"


def _wait_for_arrivals(workload: Workload, queue: list[int], start: float) -> list[int]:
    """Indices of requests that have arrived (sleeping until the next one if none has)."""
    now = time.perf_counter() - start
    arrived = [i for i in queue if workload.requests[i].arrival_time <= now]
    if not arrived:
        time.sleep(max(0.0, workload.requests[queue[0]].arrival_time - now))
        arrived = [queue[0]]
    return arrived


class _StepClock:
    """A transformers streamer that notes when each generated step's tokens come out."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # generate first hands the streamer the prompt
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class HFStaticRunner:
    """transformers `generate` on static batches: FCFS, up to `batch_size` arrived requests, left padding.

    A batch runs until its longest request is done; shorter ones are cut to their own length.
    """

    def __init__(self, hf_model: torch.nn.Module, batch_size: int, pad_token_id: int = 0) -> None:
        self.model = hf_model
        self.batch_size = batch_size
        self.pad_token_id = pad_token_id
        self.name = f"hf-static-b{batch_size}"

    @torch.inference_mode()
    def run(self, workload: Workload, progress: bool = False) -> RunResult:
        device = next(self.model.parameters()).device
        queue = sorted(range(len(workload.requests)), key=lambda i: workload.requests[i].arrival_time)
        finished: dict[int, tuple[list[int], list[float]]] = {}
        bar = tqdm(total=len(queue), desc=self.name, unit="req", disable=not progress, leave=False)
        start = time.perf_counter()
        while queue:
            batch = _wait_for_arrivals(workload, queue, start)[: self.batch_size]
            queue = [i for i in queue if i not in batch]
            requests = [workload.requests[i] for i in batch]
            width = max(len(r.prompt_token_ids) for r in requests)
            ids = [[self.pad_token_id] * (width - len(r.prompt_token_ids)) + r.prompt_token_ids for r in requests]
            mask = [[0] * (width - len(r.prompt_token_ids)) + [1] * len(r.prompt_token_ids) for r in requests]
            clock = _StepClock()
            generated = self.model.generate(
                torch.tensor(ids, device=device), attention_mask=torch.tensor(mask, device=device),
                max_new_tokens=max(r.max_tokens for r in requests), do_sample=False, eos_token_id=[],
                pad_token_id=self.pad_token_id, streamer=clock)
            for row, (i, request) in enumerate(zip(batch, requests)):
                finished[i] = (generated[row, width : width + request.max_tokens].tolist(),
                               clock.times[: request.max_tokens])
            bar.update(len(batch))
        duration = time.perf_counter() - start
        bar.close()
        return _collect(self.name, workload, start, duration, finished, {"batch_size": self.batch_size})


class HFContinuousRunner:
    """transformers' continuous batching manager, with a bounded KV pool and batch."""

    def __init__(self, hf_model: torch.nn.Module, max_requests_per_batch: int = 32, max_batch_tokens: int = 2048,
                 num_blocks: int = 256, page_size: int = 64) -> None:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        self.model = hf_model
        self.config = ContinuousBatchingConfig(num_blocks=num_blocks, page_size=page_size,
                                               max_batch_tokens=max_batch_tokens,
                                               max_requests_per_batch=max_requests_per_batch)
        self.name = "hf-continuous"

    @torch.inference_mode()
    def run(self, workload: Workload, progress: bool = False) -> RunResult:
        from transformers import GenerationConfig

        # Its notice that EOS is disabled is what we ask for: ignore EOS, as every runner does.
        logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
        generation = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0)
        pending = sorted(range(len(workload.requests)), key=lambda i: workload.requests[i].arrival_time)
        results: dict[int, Any] = {}  # transformers' GenerationOutput
        bar = tqdm(total=len(pending), desc=self.name, unit="req", disable=not progress, leave=False)
        with self.model.continuous_batching_context_manager(
                generation_config=generation, continuous_batching_config=self.config, block=True, timeout=5,
                warmup=False) as manager:
            start = time.perf_counter()
            while len(results) < len(workload.requests):
                now = time.perf_counter() - start
                while pending and workload.requests[pending[0]].arrival_time <= now:
                    i = pending.pop(0)
                    request = workload.requests[i]
                    manager.add_request(request.prompt_token_ids, request_id=f"bench-{i}",
                                        max_new_tokens=request.max_tokens, record_timestamps=True)
                result = manager.get_result(timeout=0.01)
                if result is not None and result.is_finished():
                    if result.error:
                        raise RuntimeError(f"transformers continuous batching failed: {result.error}")
                    results[int(result.request_id.removeprefix("bench-"))] = result
                    bar.update(1)
            duration = time.perf_counter() - start
        bar.close()
        return _collect(self.name, workload, start, duration, {
            i: (r.generated_tokens, r.timestamps) for i, r in results.items()})


# ------------------------------------------------------------------------------------------- report
class OutputMismatchError(RuntimeError):
    """Runners disagree on the tokens of the same greedy requests: their timings are not comparable."""


def check_same_outputs(results: Sequence[RunResult]) -> None:
    reference = results[0]
    for result in results[1:]:
        for i, (a, b) in enumerate(zip(reference.outputs, result.outputs)):
            if a != b:
                first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                raise OutputMismatchError(
                    f"{result.runner} and {reference.runner} differ on request {i} from output token {first}: "
                    f"{b[first:first + 5]} vs {a[first:first + 5]}; refusing to compare their speed")


@dataclass
class BenchmarkReport:
    workload: str
    num_requests: int
    useful_flops: float
    peaks: MachinePeaks | None
    runs: dict[str, BenchmarkMetrics]
    identical_outputs: dict[str, float]  # fraction of requests with the reference runner's tokens
    info: dict[str, dict]
    timings: dict[str, list[RequestTiming]]

    def flop_fraction(self, runner: str) -> float | None:
        """Useful FLOPs per second achieved, as a fraction of the measured matmul peak."""
        if self.peaks is None:
            return None
        return self.useful_flops / self.runs[runner].duration / self.peaks.matmul_flops

    def best_baseline(self) -> str | None:
        baselines = [name for name in self.runs if name.startswith("hf-")]
        return max(baselines, key=lambda n: self.runs[n].output_throughput, default=None)

    def table(self) -> str:
        best = self.best_baseline()
        lines = [f"{'runner':18} {'out tok/s':>10} {'x best HF':>9} {'req/s':>7} {'TTFT p50':>9} {'TPOT p50':>9} "
                 f"{'ITL p99':>8} {'FLOP roof':>9} {'same':>5}"]
        for name, m in self.runs.items():
            ratio = f"{m.output_throughput / self.runs[best].output_throughput:8.2f}x" if best else f"{'-':>9}"
            fraction = self.flop_fraction(name)
            lines.append(f"{name:18} {m.output_throughput:10.1f} {ratio} {m.request_throughput:7.2f} "
                         f"{1000 * m.ttft.median:7.0f}ms {1000 * m.tpot.median:7.1f}ms {1000 * m.itl.p99:6.0f}ms "
                         f"{'' if fraction is None else f'{100 * fraction:8.1f}%':>9} "
                         f"{100 * self.identical_outputs[name]:4.0f}%")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "workload": self.workload, "num_requests": self.num_requests, "useful_flops": self.useful_flops,
            "peaks": None if self.peaks is None else vars(self.peaks),
            "best_hf_baseline": self.best_baseline(),
            "runs": {name: {**m.to_dict(), "flop_fraction": self.flop_fraction(name),
                            "identical_outputs": self.identical_outputs[name], **self.info.get(name, {})}
                     for name, m in self.runs.items()},
        }


def run_benchmark(workload: Workload, runners: Sequence[Runner], config: ModelConfig, *,
                  peaks: MachinePeaks | None = None, num_check: int = 4, check_tokens: int = 16,
                  targets: LatencyTargets | None = None, progress: bool = True,
                  log: Callable[[str], None] = print) -> BenchmarkReport:
    """Check that every runner gives the same tokens on a few requests, then time each one on `workload`."""
    if num_check:
        check = workload.head(num_check, check_tokens)
        results = [runner.run(check) for runner in runners]  # also warms every runner up
        # A runner marked `exact = False` (another engine on other kernels: llama.cpp) is compared, not checked.
        exact = [result for runner, result in zip(runners, results) if getattr(runner, "exact", True)]
        if exact:
            check_same_outputs(exact)
        log(f"outputs checked: {len(exact)} runners agree on {len(check.requests)} requests x {check_tokens} tokens")
        for runner, result in zip(runners, results):
            if not getattr(runner, "exact", True) and exact:
                same = sum(a == b for a, b in zip(exact[0].outputs, result.outputs))
                log(f"{runner.name}: {same} of {len(check.requests)} requests give {exact[0].runner}'s tokens")
    results = []
    for runner in runners:
        results.append(runner.run(workload, progress=progress))
        log(f"{runner.name}: {results[-1].duration:.1f} s")
    reference = results[0].outputs
    identical = {r.runner: sum(a == b for a, b in zip(reference, r.outputs)) / len(reference) for r in results}
    useful = sum(request_flops(config, len(r.prompt_token_ids), r.max_tokens) for r in workload.requests)
    return BenchmarkReport(
        workload=workload.name, num_requests=len(workload.requests), useful_flops=useful, peaks=peaks,
        runs={r.runner: summarize(r.timings, r.duration, targets) for r in results},
        identical_outputs=identical, info={r.runner: r.info for r in results},
        timings={r.runner: r.timings for r in results})
