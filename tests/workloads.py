"""Workloads and checks the engine's tests share (tests/engine, tests/worker, tests/core): mixed prompts with a
shared prefix, repeats and n > 1; prompts that repeat a phrase (for prompt lookup); each request's tokens when run
alone; a pool left with nothing held."""

from __future__ import annotations

import random

from llm_runtime import LLMEngine, SamplingParams, generate

BLOCK_SIZE = 16


def shared_prefix_workload(vocab_size: int, num_requests: int = 30, seed: int = 1):
    """Half the prompts start with one 70-token system prompt; some are exact repeats; some n > 1."""
    rng = random.Random(seed)
    system = [rng.randrange(3, vocab_size) for _ in range(70)]
    workload = []
    for i in range(num_requests):
        if i % 2 == 0:
            prompt = system + [rng.randrange(3, vocab_size) for _ in range(rng.randint(1, 60))]
        elif i % 5 == 1 and i > 1:
            prompt = list(workload[i - 2][0])  # an exact repeat of an earlier prompt
        else:
            prompt = [rng.randrange(3, vocab_size) for _ in range(rng.randint(1, 120))]
        n = 3 if i % 7 == 3 else 1
        workload.append((prompt, SamplingParams(n=n, temperature=0, max_tokens=rng.randint(1, 30), ignore_eos=True)))
    return workload


def blocks_unconstrained(workload) -> int:
    """Blocks the workload would hold if every request ran at once with its own copy of everything."""
    return sum(p.n * -(-(len(prompt) + p.max_tokens) // BLOCK_SIZE) for prompt, p in workload)


def run_all(engine: LLMEngine, workload, arrive_every: int = 2) -> dict[str, list[list[int]]]:
    """A third up front, the rest arriving one every `arrive_every` steps; every completion's tokens."""
    pending = list(enumerate(workload))
    results: dict[str, list[list[int]]] = {}
    step = 0
    while engine.has_unfinished_requests() or pending:
        if pending and (step % arrive_every == 0 or step < len(workload) // 3):
            i, (prompt, params) = pending.pop(0)
            engine.add_request(str(i), prompt, params)
        for output in engine.step():
            if output.finished:
                results[output.request_id] = [c.token_ids for c in output.outputs]
        step += 1
    return results


def assert_no_leak(engine: LLMEngine) -> None:
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert not any(engine.block_manager.allocator.ref_counts)
    assert not engine.block_manager.block_tables
    assert stats.num_running == stats.num_waiting == 0 and not engine.scheduler.forks


def expected_alone(model, workload) -> list[list[int]]:
    return [generate(model, prompt, SamplingParams(temperature=0, max_tokens=p.max_tokens, ignore_eos=True))
            for prompt, p in workload]


NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}


def repetitive_workload(vocab_size: int, num_requests: int = 24, seed: int = 5):
    """Prompts that repeat a phrase (prompt lookup has something to find), a shared prefix, n > 1 for some."""
    rng = random.Random(seed)
    system = [rng.randrange(3, vocab_size) for _ in range(40)]
    workload = []
    for i in range(num_requests):
        phrase = [rng.randrange(3, vocab_size) for _ in range(rng.randint(2, 6))]
        prompt = (system if i % 2 == 0 else []) + phrase * rng.randint(2, 5) + phrase[: rng.randint(0, 2)]
        n = 2 if i % 6 == 5 else 1
        workload.append((prompt, SamplingParams(n=n, temperature=0, max_tokens=rng.randint(2, 40), ignore_eos=True)))
    return workload
