"""The tokenizer helpers on the bundled model's tokenizer."""

from __future__ import annotations

import pytest

from llm_runtime import SamplingParams, encode_chat, generate


@pytest.mark.slow
def test_chat_template_and_the_reference_answer(bundled) -> None:
    model, tokenizer = bundled
    ids = encode_chat(tokenizer, [{"role": "user", "content": "What is the capital of France?"}])
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3  # no doubled special tokens
    answer = generate(model, ids, SamplingParams(temperature=0, max_tokens=32))
    assert tokenizer.decode(answer, skip_special_tokens=True) == "The capital of France is Paris."
    assert answer[-1] in model.config.eos_token_ids
