"""Single-request generation: prefill the prompt once, then decode one token at a time from the KV cache."""

from __future__ import annotations

import time
from collections import abc

import torch

from ..model import CausalLM
from ..sampling import Sampler, SamplingParams
from .sequence import Sequence, sample_sequences


def validate_prompt(prompt_token_ids: abc.Sequence[int], vocab_size: int, max_model_len: int) -> list[int]:
    """The prompt as a list of ints, or a ValueError saying what is wrong with it."""
    if isinstance(prompt_token_ids, (str, bytes)) or not isinstance(prompt_token_ids, abc.Sequence):
        raise ValueError(f"prompt_token_ids must be a list of token ids, got {type(prompt_token_ids).__name__}")
    ids = list(prompt_token_ids)
    if not ids:
        raise ValueError("prompt_token_ids is empty: give at least one token")
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size for i in ids):
        raise ValueError(f"prompt_token_ids must be integers in [0, {vocab_size})")
    if len(ids) >= max_model_len:
        raise ValueError(f"prompt has {len(ids)} tokens; the model's context is {max_model_len}")
    return ids


def max_new_tokens(params: SamplingParams, prompt_len: int, max_model_len: int) -> int:
    """How many tokens a request may generate: max_tokens, and never past the context."""
    room = max_model_len - prompt_len
    if params.max_tokens is None:
        return room
    if params.max_tokens > room:
        raise ValueError(
            f"max_tokens={params.max_tokens} with a {prompt_len}-token prompt exceeds the model's "
            f"context of {max_model_len} tokens (at most {room})"
        )
    return params.max_tokens


@torch.inference_mode()
def generate(
    model: CausalLM,
    prompt_token_ids: abc.Sequence[int],
    sampling_params: SamplingParams | None = None,
    *,
    sampler: Sampler | None = None,
) -> list[int]:
    """Generate for one prompt; returns the new token ids (EOS included when it ended the request).

    Stops at EOS (unless `ignore_eos`), a `stop_token_ids` token or `max_tokens`. Stop strings
    need text, so they are honoured by the engine (`LLM`), which owns a tokenizer.
    """
    params = sampling_params or SamplingParams()
    config = model.config
    prompt = validate_prompt(prompt_token_ids, config.vocab_size, config.max_position_embeddings)
    budget = max_new_tokens(params, len(prompt), config.max_position_embeddings)
    sampler = sampler or Sampler(device=model.device)
    seq = Sequence("generate", prompt, params, max_new_tokens=budget, eos_token_ids=config.eos_token_ids,
                   generator=params.make_generator(model.device))

    kv_cache = model.new_kv_cache(batch_size=1, max_seq_len=len(prompt) + budget)
    input_ids = torch.tensor([prompt], device=model.device)  # (1, prompt_len): prefill
    while not seq.is_finished:
        hidden = model(input_ids, kv_cache)  # (1, T, hidden)
        logits = model.compute_logits(hidden[:, -1])  # (1, vocab): only the last position is needed
        token = sample_sequences(sampler, logits, [seq]).token_ids
        # The one host-device sync per token: we must know the token to decide whether to stop.
        seq.append_token(int(token.item()), time.perf_counter())
        input_ids = token[:, None]  # (1, 1): decode feeds back only the new token
    return seq.output_token_ids
