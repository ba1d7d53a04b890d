"""Static batching: padded rectangles give every request its tokens alone; finished rows waste slots."""

from __future__ import annotations

import pytest

from llm_runtime import SamplingParams, Sequence, StaticBatchRunner, generate
from test_engine import make_workload


def _sequences(workload, eos_token_ids) -> list[Sequence]:
    return [Sequence(str(i), prompt, params, max_new_tokens=params.max_tokens, eos_token_ids=eos_token_ids)
            for i, (prompt, params) in enumerate(workload)]


@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3"])
def test_static_batches_equal_each_request_alone(tiny_pairs, family: str) -> None:
    model, _ = tiny_pairs[family]
    workload = make_workload(model.config.vocab_size, num_requests=16, seed=1)
    runner = StaticBatchRunner(model, max_batch_size=5, max_num_batched_tokens=1200, record_steps=True)
    sequences = runner.run(_sequences(workload, model.config.eos_token_ids))
    for seq, (prompt, params) in zip(sequences, workload):
        assert seq.is_finished
        assert seq.output_token_ids == generate(model, prompt, params), f"request {seq.request_id}"
    # Rows that finished early still sit in their batch: some steps have idle slots.
    assert any(any(n == 0 for _, _, n, _ in record.items) for record in runner.step_records)


def test_fcfs_batches_respect_both_caps(tiny_pairs) -> None:
    model, _ = tiny_pairs["llama2"]
    runner = StaticBatchRunner(model, max_batch_size=3, max_num_batched_tokens=100)
    params = SamplingParams(max_tokens=1)
    waiting = _sequences([([1] * n, params) for n in (10, 20, 30, 40, 5)], ())
    assert [s.num_prompt_tokens for s in runner.next_batch(waiting)] == [10, 20, 30]  # 3 x 30 <= 100
    assert [s.num_prompt_tokens for s in runner.next_batch(waiting[1:])] == [20, 30]  # 3 x 40 > 100
    assert [s.num_prompt_tokens for s in runner.next_batch(_sequences([([1] * 500, params)], ()))] == [500]
