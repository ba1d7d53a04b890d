"""Lesson 08 exercises: what a prefix cache finds, checked against the block manager and the scheduler.

- `num_cached_tokens(cached_prompts, prompt, block_size)`: the leading tokens of a prompt found in
  the cache, against `BlockManager.num_cached_tokens` after the cached prompts ran.
- `hit_rate(prompts, block_size)`: the prefix cache hit rate of prompts served one after another,
  against the `Scheduler`'s own counters.
"""

from __future__ import annotations

import random

from ...config import EngineConfig
from ...core.block_manager import BlockManager
from ...core.scheduler import Scheduler
from ...core.sequence import Sequence
from ...sampling import SamplingParams
from .check import Case, Verdict, close_numbers, run_cases, same_value


def package_cached_tokens(cached_prompts: list[list[int]], prompt: list[int], block_size: int) -> int:
    """Run each cached prompt's prefill through a BlockManager (blocks named, then freed: they stay cached),
    then ask how many of `prompt`'s leading tokens it would reuse."""
    manager = BlockManager(4 + sum(len(p) for p in cached_prompts) + len(prompt), block_size)  # room: no eviction
    for i, tokens in enumerate(cached_prompts):
        manager.allocate(i, tokens)
        manager.mark_computed(i, tokens, len(tokens))
        manager.free(i)
    return manager.num_cached_tokens(prompt)


def _prompt(rng: random.Random, base: list[int] | None = None) -> list[int]:
    """A short prompt over three token ids; often a prefix of `base` with a different tail."""
    if base is not None and rng.random() < 0.7:
        keep = rng.randint(0, len(base))
        return base[:keep] + [rng.randrange(3) for _ in range(rng.randint(0 if keep else 1, 6))]
    return [rng.randrange(3) for _ in range(rng.randint(1, 14))]


def check_num_cached_tokens(fn: object) -> Verdict:
    """`num_cached_tokens(cached_prompts, prompt, block_size) -> int`: every prompt in `cached_prompts` was
    prefilled earlier and its full blocks of `block_size` tokens are in the prefix cache (nothing was
    evicted). A block is found only if its own tokens and every token before it are equal. Return how
    many leading tokens of `prompt` are found: whole blocks only, and never the whole prompt (its last
    token must run to produce the next token's logits)."""

    def cases() -> list[Case]:
        rng = random.Random(8)
        inputs = [([[1, 2, 3, 4, 5, 6, 7, 8]], [1, 2, 3, 4, 5, 6, 9], 4, "one full block matches"),
                  ([[1, 2, 3, 4, 5, 6, 7, 8]], [1, 2, 3, 4, 5, 6, 7, 8], 4, "the same prompt again"),
                  ([[1, 2, 3, 4, 5, 6]], [1, 2, 3, 4, 5, 6, 7, 8, 9], 4, "a cached partial block is not named"),
                  ([[9, 9, 1, 2, 3, 4]], [1, 2, 3, 4, 5], 2, "equal blocks after a different start do not match")]
        for _ in range(50):
            block_size = rng.choice([1, 2, 3, 4])
            cached: list[list[int]] = []
            for _ in range(rng.randint(0, 4)):
                cached.append(_prompt(rng, rng.choice(cached) if cached else None))
            prompt = _prompt(rng, rng.choice(cached) if cached else None)
            inputs.append((cached, prompt, block_size, ""))
        return [Case({"cached_prompts": cached, "prompt": prompt, "block_size": size},
                     package_cached_tokens(cached, prompt, size), note) for cached, prompt, size, note in inputs]

    return run_cases("num_cached_tokens", fn, cases, same_value, "llm_runtime.BlockManager.num_cached_tokens")


def scheduler_hit_rate(prompts: list[list[int]], block_size: int) -> float:
    """Serve the prompts one after another (one token each) through the package's Scheduler; its hit rate."""
    config = EngineConfig(max_num_seqs=1, max_num_batched_tokens=64, block_size=block_size)
    scheduler = Scheduler(config, BlockManager(4 + sum(len(p) for p in prompts), block_size))
    for i, prompt in enumerate(prompts):
        seq = Sequence(str(i), list(prompt), SamplingParams(temperature=0, max_tokens=1), max_new_tokens=1)
        scheduler.add(seq)
        while not seq.is_finished:
            batch = scheduler.schedule()
            scheduler.postprocess(batch, {item.seq: 0 for item in batch.items if item.samples}, now=0.0)
    return scheduler.num_prefix_hit_tokens / scheduler.num_prefix_queried_tokens


def check_hit_rate(fn: object) -> Verdict:
    """`hit_rate(prompts, block_size) -> float`: the prompts arrive one after another, each finishing
    before the next arrives, and every full prompt block stays cached. Return the prefix cache hit
    rate: the tokens found in the cache (as `num_cached_tokens` counts them, against every earlier
    prompt) over all prompt tokens looked up (every token of every prompt)."""

    def cases() -> list[Case]:
        rng = random.Random(8)
        inputs = [([[1, 2, 3, 4, 5], [1, 2, 3, 4, 6]], 2, "the second prompt finds 4 of its 5 tokens: 4 / 10"),
                  ([[1, 2, 3, 4]] * 3, 2, "the same prompt three times")]
        for _ in range(30):
            prompts: list[list[int]] = []
            for _ in range(rng.randint(1, 5)):
                prompts.append(_prompt(rng, rng.choice(prompts) if prompts else None))
            inputs.append((prompts, rng.choice([1, 2, 3, 4]), ""))
        return [Case({"prompts": prompts, "block_size": size}, scheduler_hit_rate(prompts, size), note)
                for prompts, size, note in inputs]

    return run_cases("hit_rate", fn, cases, close_numbers(rel_tol=1e-9),
                     "llm_runtime.Scheduler (its prefix cache counters)")
