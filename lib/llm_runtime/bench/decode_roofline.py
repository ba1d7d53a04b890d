"""Batch-1 decode against the memory-bandwidth roofline, per execution mode (eager, compiled, graphs).

One sequence decoding reads every weight once per token and does almost no arithmetic with it, so
the fastest a step can be is the weight bytes over the memory bandwidth (`roofline.weight_bytes`
over the measured read bandwidth, `roofline.machine_peaks`). What a real step adds is everything else: the KV reads (small at
short contexts), kernel launches, and the engine's Python around the forward. The fraction
roofline / step says how much of the step is the unavoidable part.

    python -m llm_runtime roofline --device cuda --dtype bfloat16 --modes eager,compiled,graphs

Modes are engine settings: "eager" (enforce_eager), "compiled" (on the CPU the whole forward pass as one
torch.compile graph, `compile_model`; on CUDA the pointwise parts compiled, no graphs), "graphs"
(compiled, and decode steps replayed from CUDA graphs; CUDA only) and "native" (the step as one native call,
worker/native_step.py; the CPU only).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..engine import LLM, LLMEngine
from ..worker.native_step import native_step_unavailable_reason
from ..model import CausalLM
from ..model.packed_linear import packing_unsupported_reason
from ..sampling import SamplingParams
from .roofline import machine_peaks, weight_bytes

MODES: dict[str, dict[str, object]] = {
    "eager": {"enforce_eager": True},
    "compiled": {"compile_pointwise": True, "cuda_graphs": False},  # on CUDA; on the CPU, CPU_COMPILED
    "graphs": {"compile_pointwise": True, "cuda_graphs": True},
    "native": {"compile_model": True, "native_step": True},  # the CPU's: the step as one native call (lesson 19)
}
# What "compiled" is on the CPU (no graphs to replay): the compiled forward pass, not the native step.
CPU_COMPILED: dict[str, object] = {"compile_model": True, "native_step": False}


def mode_options(mode: str, device: torch.device) -> dict[str, object]:
    """The engine settings of `mode` on `device`."""
    return CPU_COMPILED if mode == "compiled" and device.type == "cpu" else MODES[mode]


@dataclass(frozen=True)
class DecodeMeasurement:
    mode: str
    step_ms: float  # median wall time of one engine step (one token) at batch 1
    tokens_per_s: float
    weight_mb: float  # bytes read per step for the weights (linears and the output projection)
    bandwidth_gb_s: float  # the device's read bandwidth (roofline.machine_peaks)
    roofline_ms: float  # weight bytes / bandwidth: the step time no engine can beat
    roofline_fraction: float  # roofline_ms / step_ms


def decode_step_seconds(model: CausalLM, engine_options: dict[str, object], *, owns_model: bool = False,
                        prompt_len: int = 32, num_steps: int = 64, warmup: int = 8) -> float:
    """Median seconds of an engine step decoding one sequence (after its prefill and `warmup` steps).
    `owns_model`: the engine treats the model as its own (`LLM.from_model`: packed, compiled where it applies)."""
    engine = LLM.from_model(model, None, max_num_seqs=1, owns_model=owns_model, **engine_options).llm_engine
    try:
        return interleaved_step_seconds({"engine": engine}, prompt_len=prompt_len, num_steps=num_steps,
                                        warmup=warmup)["engine"]
    finally:
        engine.shutdown()


def interleaved_step_seconds(engines: dict[str, LLMEngine], *, prompt_len: int = 32, num_steps: int = 64,
                             warmup: int = 8, batch_size: int = 1) -> dict[str, float]:
    """Median seconds of a step decoding `batch_size` sequences in each engine (idle ones), the engines stepping in
    turn: on a noisy machine a slow moment slows every engine alike, so their ratios hold."""
    for engine in engines.values():
        vocab_size = engine.model.config.vocab_size
        generator = torch.Generator().manual_seed(0)
        for i in range(batch_size):
            prompt = torch.randint(3, vocab_size, (prompt_len,), generator=generator)
            engine.add_request(f"decode-{i}", {"prompt_token_ids": prompt.tolist()},
                               SamplingParams(temperature=0, max_tokens=warmup + num_steps + 2, ignore_eos=True))
        for _ in range(1 + warmup):  # the prefill, then steps that may still compile or warm caches
            engine.step()
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(num_steps):
        for name, engine in engines.items():
            start = time.perf_counter()
            engine.step()  # returns after the sampled token reached the host: the GPU's work is done
            times[name].append(time.perf_counter() - start)
    for engine in engines.values():
        for i in range(batch_size):
            engine.abort_request(f"decode-{i}")
    return {name: statistics.median(seconds) for name, seconds in times.items()}


def measure(model: CausalLM, modes: list[str], *, prompt_len: int = 32, num_steps: int = 64,
            prepack_weights: bool | None = None, bandwidth: float | None = None) -> list[DecodeMeasurement]:
    """Each mode's batch-1 step against the roofline of this model on its device, in one process.
    `bandwidth` (bytes/s): the device's, if already measured; else this machine's (`roofline.machine_peaks`)."""
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise ValueError(f"unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}")
    if "graphs" in modes and model.device.type != "cuda":
        raise ValueError("the graphs mode needs a CUDA device")
    if "native" in modes and model.device.type != "cpu":
        raise ValueError("the native mode runs on the CPU")
    dtype_size = model.dtype.itemsize
    nbytes = weight_bytes(model.config, dtype_size)
    if bandwidth is None:
        bandwidth = machine_peaks(model.device, model.dtype).memory_bandwidth
    if prepack_weights is None:
        prepack_weights = packing_unsupported_reason(model) is None
    results = []
    for mode in modes:
        # The native step reads plain weights: packed, it would read a plain copy beside them.
        packed = prepack_weights and mode != "native"
        seconds = decode_step_seconds(model, {**mode_options(mode, model.device), "prepack_weights": packed},
                                      prompt_len=prompt_len, num_steps=num_steps)
        roofline = nbytes / bandwidth
        results.append(DecodeMeasurement(mode, seconds * 1e3, 1 / seconds, nbytes / 1e6, bandwidth / 1e9,
                                         roofline * 1e3, roofline / seconds))
    return results


def table(results: list[DecodeMeasurement]) -> str:
    """A Markdown table of the measurements."""
    lines = ["| mode | step (ms) | tokens/s | weights (MB) | bandwidth (GB/s) | roofline (ms) | of roofline |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r.mode} | {r.step_ms:.3f} | {r.tokens_per_s:.1f} | {r.weight_mb:.1f} | {r.bandwidth_gb_s:.1f} | "
              f"{r.roofline_ms:.3f} | {r.roofline_fraction:.1%} |" for r in results]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="local folder or hub id (default: bundled SmolLM2)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--modes", default=None,
                        help=f"comma-separated, from {', '.join(MODES)} (default: all this device runs)")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--num-steps", type=int, default=64)
    parser.add_argument("--output-dir", default=None, help="also write roofline.json and roofline.md there")


def run(args: argparse.Namespace) -> int:
    from ..model import load_model

    try:
        model, _ = load_model(args.model, device=args.device, dtype=args.dtype)
        runs = {"graphs": model.device.type == "cuda",  # the modes this device and model run
                "native": native_step_unavailable_reason(model, "auto") is None}
        modes = args.modes.split(",") if args.modes else [m for m in MODES if runs.get(m, True)]
        results = measure(model, modes, prompt_len=args.prompt_len, num_steps=args.num_steps)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    text = f"batch-1 decode on {model.device.type}, {str(model.dtype).removeprefix('torch.')}\n\n{table(results)}"
    print(text)
    if args.output_dir:
        out = Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "roofline.json").write_text(json.dumps([asdict(r) for r in results], indent=2))
        (out / "roofline.md").write_text(text + "\n")
    return 0
