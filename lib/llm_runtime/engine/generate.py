"""Single-request generation: prefill the prompt once, then decode one token at a time from the KV cache."""

from __future__ import annotations

import time
from collections import abc

import torch

from ..model import CausalLM
from ..sampling import Sampler, SamplingParams
from .input_processor import max_new_tokens, validate_prompt, validate_stop_token_ids
from ..core.sequence import Sequence, sample_sequences


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
    validate_stop_token_ids(params, config.vocab_size)
    sampler = sampler or Sampler(device=model.device)
    seq = Sequence("generate", prompt, params, max_new_tokens=budget, eos_token_ids=config.eos_token_ids,
                   generator=params.make_generator())

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
