"""Tokenizers: the checkpoint's own (Hugging Face `tokenizers` under the hood), plus the chat template."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

Tokenizer = PreTrainedTokenizerBase


def load_tokenizer(folder: str | Path) -> Tokenizer:
    """The tokenizer saved in a model folder (tokenizer.json, its config and chat template)."""
    return AutoTokenizer.from_pretrained(str(folder))


def encode_chat(tokenizer: Tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of `messages` rendered by the chat template, ending where the assistant's reply starts."""
    if tokenizer.chat_template is None:
        raise ValueError("this tokenizer has no chat template; pass plain prompts instead")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # The template already wrote any BOS token; don't let encode add a second one.
    return tokenizer.encode(text, add_special_tokens=False)
