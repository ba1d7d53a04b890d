"""llama.cpp as a runner (bench/llamacpp_runner.py): a missing build says how to make it; where `make llamacpp-env`
built it, llama-bench's figures are read and llama-server serves a workload, token by token, at arrival times."""

from __future__ import annotations

import pytest

from llm_runtime import LLM
from llm_runtime.bench.benchmark import fixed_workload, run_benchmark, with_poisson_arrivals
from llm_runtime.bench.cli import main as bench_main
from llm_runtime.bench.llamacpp_runner import (DEFAULT_LLAMACPP_DIR, LlamaServerRunner, engine_bench, llama_bench,
                                               require_llamacpp)
from llm_runtime.model import load_model
from llm_runtime.model.bundled import find_bundled_gguf

BUILT = (DEFAULT_LLAMACPP_DIR / "llama-server").is_file() and (DEFAULT_LLAMACPP_DIR / "llama-bench").is_file()
needs_build = pytest.mark.skipif(not BUILT, reason=f"llama.cpp is not built in {DEFAULT_LLAMACPP_DIR} (`make "
                                                   f"llamacpp-env` builds it, 15-30 minutes on 2 cores)")


def test_a_missing_build_says_how_to_make_it(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="make llamacpp-env"):
        require_llamacpp(tmp_path, "llama-server")
    with pytest.raises(FileNotFoundError, match="make llamacpp-env"):
        LlamaServerRunner(find_bundled_gguf(), threads=2, bin_dir=tmp_path)
    assert bench_main(["--runners", "engine,llamacpp", "--llamacpp-dir", str(tmp_path)]) == 2
    assert bench_main(["--runners", "llamacpp", "--model", "some/model"]) == 2


def test_the_engine_in_llama_benchs_terms() -> None:
    model, _ = load_model(quantization="gguf")
    with LLM.from_model(model, None, kv_cache_memory=64 << 20, max_num_seqs=1) as llm:
        figures = engine_bench(llm.llm_engine, prompt_tokens=32, generated_tokens=8, repetitions=1)
        assert not llm.llm_engine.has_unfinished_requests()
        with pytest.raises(ValueError, match="token budget"):
            engine_bench(llm.llm_engine, prompt_tokens=4096)
    assert set(figures) == {"pp32", "tg8"} and all(f["mean"] > 0 for f in figures.values())


@needs_build
def test_llama_bench_figures() -> None:
    figures = llama_bench(find_bundled_gguf(), threads=2, prompt_tokens=16, generated_tokens=8, repetitions=1)
    assert set(figures) == {"pp16", "tg8"} and all(f["mean"] > 0 for f in figures.values())


@needs_build
def test_llama_server_serves_a_workload_token_by_token(tmp_path) -> None:
    workload = with_poisson_arrivals(fixed_workload(4, 12, 6, vocab_size=49152, seed=3), rate=20)
    runner = LlamaServerRunner(find_bundled_gguf(), threads=2, parallel=2, context=512, log_path=tmp_path / "log")
    result = runner.run(workload)
    assert [len(tokens) for tokens in result.outputs] == [6] * 4  # EOS ignored, n_predict honoured
    for request, timing in zip(workload.requests, result.timings):
        assert timing.start == request.arrival_time  # its clock starts with the first request
        assert list(timing.token_times) == sorted(timing.token_times) and timing.token_times[0] >= timing.start
    assert result.info["parallel"] == 2 and result.info["llamacpp_version"] != "unknown"


@needs_build
def test_its_tokens_are_compared_not_required(tmp_path) -> None:
    """In `run_benchmark`, llama.cpp's tokens need not equal the engine's: the report says how many do."""
    from llm_runtime.bench.benchmark import EngineRunner

    model, _ = load_model(quantization="gguf")
    workload = fixed_workload(2, 8, 8, vocab_size=model.config.vocab_size, seed=1)
    runners = [EngineRunner(model, "llm_runtime", kv_cache_memory=64 << 20),
               LlamaServerRunner(find_bundled_gguf(), threads=2, parallel=2, context=512, log_path=tmp_path / "log")]
    report = run_benchmark(workload, runners, model.config, num_check=2, check_tokens=4, progress=False,
                           log=lambda _: None)
    assert set(report.identical_outputs) == {"llm_runtime", "llama.cpp"}
    assert report.identical_outputs["llm_runtime"] == 1.0
