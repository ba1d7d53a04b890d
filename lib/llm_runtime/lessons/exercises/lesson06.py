"""Lesson 06 exercises: how big the KV pool is, and which requests it can never hold.

Both checkers build small engines' worth of real package objects around a tiny random model on
the CPU (a few kilobytes of weights).

- `pool_blocks(...)`: the KV budget rule of `worker/kv_budget.py` (device memory x utilization minus
  what is held, capped at what max_num_seqs full-length sequences use in whole blocks), in blocks, against
  `kv_cache_memory` and `num_blocks_in`.
- `refusal(prompt_len, max_tokens, context_len, num_kv_blocks, block_size)`: which field the engine
  refuses a request for (or None), against `LLMEngine.add_request`.
"""

from __future__ import annotations

import random
from dataclasses import replace

from ...attention.kv_cache import num_blocks_in
from ...config import EngineConfig, ModelConfig
from ...engine.engine import LLMEngine
from ...worker.kv_budget import CPU_DEVICE, activation_bytes, kv_cache_memory
from ...errors import InvalidRequestError
from ...model import CausalLM
from ...sampling import SamplingParams
from .check import Case, Verdict, run_cases, same_value


def tiny_model(max_position_embeddings: int = 256, num_layers: int = 2) -> CausalLM:
    """A random-weight Llama with 8-wide layers, float32 on the CPU: real shapes, no cost."""
    config = ModelConfig(model_type="llama", vocab_size=16, hidden_size=8, intermediate_size=16, num_layers=num_layers,
                         num_heads=2, num_kv_heads=1, head_dim=4, max_position_embeddings=max_position_embeddings)
    return CausalLM(config)


def check_pool_blocks(fn: object) -> Verdict:
    """`pool_blocks(device_memory, gpu_memory_utilization, held_bytes, max_num_seqs, max_model_len,
    bytes_per_token, block_size) -> int`: the number of KV blocks an engine gets when the config names
    no size: the bytes it may use are device_memory x gpu_memory_utilization (rounded down to whole
    bytes) minus `held_bytes` (weights, activations, other live engines), but never more than
    max_num_seqs sequences of max_model_len tokens need, each in whole blocks; a block holds block_size
    tokens of bytes_per_token bytes each; only whole blocks count."""

    def cases() -> list[Case]:
        rng = random.Random(6)
        model = tiny_model()
        bytes_per_token = model.config.kv_bytes_per_token(4)
        held_by_others = CPU_DEVICE.held_bytes(model.device, besides=[model])  # this process's live engines, weights
        out = []
        for headroom_binds in (True, False, True, False):  # few: each case collects garbage once (0.1-0.2 s)
            block_size = rng.choice([1, 4, 16])
            max_num_seqs, max_model_len = rng.randint(1, 8), rng.randint(48, 256)
            config = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=rng.randint(max_num_seqs, 512),
                                  block_size=block_size, gpu_memory_utilization=rng.choice([0.5, 0.8, 0.9, 1.0]))
            held = held_by_others + activation_bytes(model, config)
            full = max_num_seqs * max_model_len * bytes_per_token
            if headroom_binds:
                headroom = rng.randint(2 * block_size * bytes_per_token, full - 1)
            else:
                headroom = full + rng.randint(0, full)
            memory = int((held + headroom) / config.gpu_memory_utilization) + rng.randint(0, 99)
            config = replace(config, cpu_device_memory=memory)
            nbytes = kv_cache_memory(model, config, max_model_len)
            expected = num_blocks_in(nbytes, model.config, block_size, model.dtype)
            out.append(Case({"device_memory": memory, "gpu_memory_utilization": config.gpu_memory_utilization,
                             "held_bytes": held, "max_num_seqs": max_num_seqs, "max_model_len": max_model_len,
                             "bytes_per_token": bytes_per_token, "block_size": block_size}, expected,
                            "the memory left binds" if headroom_binds else "max_num_seqs x max_model_len binds"))
        return out

    return run_cases("pool_blocks", fn, cases, same_value, "llm_runtime.worker.kv_budget.kv_cache_memory")


def engine_refusal(prompt_len: int, max_tokens: int, context_len: int, num_kv_blocks: int, block_size: int,
                   models: dict[int, CausalLM]) -> tuple[str | None, str]:
    """The field a real LLMEngine (model context `context_len`, a pool of num_kv_blocks blocks) refuses
    this request for, or None; and its message."""
    model = models.setdefault(context_len, tiny_model(context_len, num_layers=1))
    engine = LLMEngine(model, None, EngineConfig(max_num_seqs=1, max_num_batched_tokens=max(context_len, 1),
                                                 num_kv_blocks=num_kv_blocks, block_size=block_size))
    try:
        engine.add_request("exercise", [1] * prompt_len, SamplingParams(temperature=0, max_tokens=max_tokens))
        return None, "accepted"
    except InvalidRequestError as error:
        return error.param, str(error)
    finally:
        engine.shutdown()


def check_refusal(fn: object) -> Verdict:
    """`refusal(prompt_len, max_tokens, context_len, num_kv_blocks, block_size) -> str | None`: an engine
    whose model has `context_len` positions and whose pool has `num_kv_blocks` blocks of `block_size`
    tokens gets a prompt of `prompt_len` tokens asking for `max_tokens` new ones. Return "prompt" if the
    prompt is refused (it leaves no room for one new token in the context, or the prompt plus one new
    token need more blocks than the whole pool has: it could never run), else "max_tokens" if
    max_tokens does not fit after the prompt in the context the engine offers (the model's context, or
    less when the pool holds fewer tokens), else None (accepted)."""

    def cases() -> list[Case]:
        rng, models = random.Random(6), {}
        inputs = [(8, 4, 64, 4, 4, "fits"), (64, 1, 64, 100, 4, "the prompt fills the context"),
                  (16, 1, 64, 2, 8, "prompt + 1 needs 3 blocks of a 2-block pool"),
                  (10, 7, 64, 2, 8, "the pool's 16 tokens leave room for 6"), (10, 6, 64, 2, 8, "exactly fits")]
        for _ in range(40):
            block_size, num_blocks = rng.choice([1, 2, 4, 8]), rng.randint(1, 12)
            context_len = rng.choice([8, 16, 32, 64])
            limit = min(context_len, num_blocks * block_size)
            prompt_len = rng.randint(max(1, limit - 4), limit + 2)
            inputs.append((prompt_len, rng.randint(1, max(1, limit - prompt_len + 2)), context_len, num_blocks,
                           block_size, ""))
        out = []
        for prompt_len, max_tokens, context_len, num_blocks, block_size, note in inputs:
            field, message = engine_refusal(prompt_len, max_tokens, context_len, num_blocks, block_size, models)
            out.append(Case({"prompt_len": prompt_len, "max_tokens": max_tokens, "context_len": context_len,
                             "num_kv_blocks": num_blocks, "block_size": block_size}, field,
                            note + ("; " if note else "") + f"the engine says: {message}"))
        return out

    return run_cases("refusal", fn, cases, same_value, "llm_runtime.LLMEngine.add_request")

