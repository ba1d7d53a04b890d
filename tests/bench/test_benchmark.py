"""Benchmark harness: reproducible workloads, the output check, and the `bench` command end to end."""

from __future__ import annotations

import json
import statistics

import pytest

from llm_runtime.__main__ import main
from llm_runtime.bench.benchmark import (OutputMismatchError, RunResult, Workload, fixed_workload, run_benchmark,
                                   shared_prefix_workload, uniform_workload, with_poisson_arrivals)
from llm_runtime.bench.metrics import RequestTiming


def test_workloads_are_reproducible_from_their_seed() -> None:
    a = uniform_workload(64, scale=8, vocab_size=5000, seed=3)
    b = uniform_workload(64, scale=8, vocab_size=5000, seed=3)
    assert a == b and a != uniform_workload(64, scale=8, vocab_size=5000, seed=4)
    lengths = [len(r.prompt_token_ids) for r in a.requests] + [r.max_tokens for r in a.requests]
    assert min(lengths) >= 100 // 8 and max(lengths) <= 1024 // 8
    assert all(100 <= t < 5000 for r in a.requests for t in r.prompt_token_ids)
    fixed = fixed_workload(5, 7, 3, vocab_size=5000)
    assert {(len(r.prompt_token_ids), r.max_tokens) for r in fixed.requests} == {(7, 3)}
    shared = shared_prefix_workload(4, 20, 5, 2, vocab_size=5000)
    assert len({tuple(r.prompt_token_ids[:20]) for r in shared.requests}) == 1
    assert len({tuple(r.prompt_token_ids) for r in shared.requests}) == 4


def test_poisson_arrivals() -> None:
    online = with_poisson_arrivals(fixed_workload(2000, 2, 2, vocab_size=500), rate=4.0, seed=1)
    times = [r.arrival_time for r in online.requests]
    assert times[0] == 0.0 and times == sorted(times) and online.is_online
    assert statistics.mean(b - a for a, b in zip(times, times[1:])) == pytest.approx(0.25, rel=0.1)
    assert online == with_poisson_arrivals(fixed_workload(2000, 2, 2, vocab_size=500), rate=4.0, seed=1)
    with pytest.raises(ValueError):
        with_poisson_arrivals(online, rate=0)


class _Fake:
    def __init__(self, name: str, outputs: list[list[int]]) -> None:
        self.name, self.outputs = name, outputs

    def run(self, workload: Workload, progress: bool = False) -> RunResult:
        timings = [RequestTiming(0.0, tuple(0.1 * (i + 1) for i in range(len(o))), 3) for o in self.outputs]
        return RunResult(self.name, self.outputs[: len(workload.requests)], timings, 1.0)


def test_a_comparison_of_runners_that_disagree_is_refused(tiny_pairs) -> None:
    model, _ = tiny_pairs["llama2"]
    workload = fixed_workload(2, 3, 2, vocab_size=model.config.vocab_size)
    agree = [_Fake("engine", [[1, 2], [3, 4]]), _Fake("hf-static-b2", [[1, 2], [3, 4]])]
    report = run_benchmark(workload, agree, model.config, log=lambda _: None, progress=False)
    assert report.identical_outputs == {"engine": 1.0, "hf-static-b2": 1.0}
    assert report.best_baseline() == "hf-static-b2" and "hf-static-b2" in report.table()
    disagree = [_Fake("engine", [[1, 2], [3, 4]]), _Fake("hf-static-b2", [[1, 2], [3, 5]])]
    with pytest.raises(OutputMismatchError, match="request 1 from output token 1"):
        run_benchmark(workload, disagree, model.config, log=lambda _: None, progress=False)


@pytest.mark.slow
def test_bench_command_end_to_end_on_the_bundled_model(bundled, tmp_path) -> None:
    """Every runner, offline and online at two rates: the table, the JSON and the plots."""
    code = main(["bench", "--num-requests", "4", "--scale", "64", "--batch-sizes", "2,4", "--max-num-seqs", "4",
                 "--rates", "20,40", "--num-check", "2", "--no-progress", "--output-dir", str(tmp_path),
                 "--attention-backends", "auto,torch-gather", "--no-compile-model"])  # compiling: test_compiled_forward
    assert code == 0
    summary = json.loads((tmp_path / "bench.json").read_text())
    assert [run["rate"] for run in summary["runs"]] == [20.0, 40.0]
    for run in summary["runs"]:
        assert set(run["runs"]) == {"llm_runtime", "llm_runtime/torch-gather", "hf-static-b2", "hf-static-b4",
                                    "hf-continuous"}
        assert run["runs"]["llm_runtime/torch-gather"]["stats"]["attention_backend"] == "torch-gather"
        assert all(r["identical_outputs"] == 1.0 and r["output_throughput"] > 0 for r in run["runs"].values())
        assert run["peaks"]["matmul_flops"] > 0 and 0 < run["runs"]["llm_runtime"]["flop_fraction"]
    assert {p.name for p in tmp_path.glob("*.png")} == {"throughput.png", "latency_cdf.png", "ttft_vs_rate.png"}
    assert main(["bench", "--runners", "engine,vllm", "--output-dir", str(tmp_path)]) == 2
    assert main(["bench", "--attention-backends", "fastest", "--output-dir", str(tmp_path)]) == 2
    assert main(["bench", "--batch-invariant", "--compile-pointwise", "--output-dir", str(tmp_path)]) == 2


def test_bench_speculates_when_asked_and_reports_the_acceptance(bundled, tmp_path, capsys) -> None:
    """`--speculative-config JSON` reaches the engine; the step breakdown says how the guesses paid."""
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}'
    code = main(["bench", "--runners", "engine", "--workload", "shared-prefix", "--num-requests", "4",
                 "--prefix-len", "48", "--input-len", "16", "--output-len", "24", "--max-num-seqs", "4",
                 "--no-compile-model", "--no-progress", "--output-dir", str(tmp_path), "--speculative-config", spec])
    assert code == 0
    printed = capsys.readouterr().out
    assert "llm_runtime step time: propose" in printed and "llm_runtime speculation:" in printed
    stats = json.loads((tmp_path / "bench.json").read_text())["runs"][0]["runs"]["llm_runtime"]["stats"]
    assert stats["num_draft_tokens"] > 0 and len(stats["accepted_length_counts"]) == 4
    for bad in ('{"method": "medusa", "num_speculative_tokens": 2}', "not json"):
        with pytest.raises(SystemExit):
            main(["bench", "--speculative-config", bad])
    assert "--speculative-config" in capsys.readouterr().err
