"""IncrementalDetokenizer: deltas that join to the decoded text, at a cost per token that stays bounded.

A byte tokenizer (token i < 256 is byte i, 256 a special token) shows what a byte-level BPE does at its
worst: a character's bytes in separate tokens, bytes that never form a character, tokens that decode to
nothing. Every decode call is recorded, so the work the detokenizer does per token is measured, not guessed.
(Streaming through the output processor, on the bundled tokenizer: test_output_processor.py, test_sequence.py.)
"""

from __future__ import annotations

import pytest

from llm_runtime import IncrementalDetokenizer

SPECIAL = 256
MULTIBYTE = "Hello 世界! Emoji: 🌍🚀 and café, naïve, 日本語. 👩‍👩‍👧 done"


class ByteTokenizer:
    """Token i < 256 is the byte i; SPECIAL decodes to "<s>", or to nothing when special tokens are skipped.
    `calls` holds the length of every decode."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        self.calls.append(len(token_ids))
        data = b"".join(b"" if t == SPECIAL and skip_special_tokens else b"<s>" if t == SPECIAL else bytes([t])
                        for t in token_ids)
        return data.decode("utf-8", errors="replace")


def _stream(tokenizer: ByteTokenizer, token_ids: list[int], prompt: str = "Prompt: ") -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt))
    return [detokenizer.add(token) for token in token_ids] + [detokenizer.flush()]


def test_text_in_separate_bytes_comes_out_whole_and_exact() -> None:
    tokenizer = ByteTokenizer()
    deltas = _stream(tokenizer, tokenizer.encode(MULTIBYTE))
    assert "".join(deltas) == MULTIBYTE
    assert all("\ufffd" not in delta for delta in deltas)  # never half a character
    assert "" in deltas  # bytes that only completed a character later
    assert max(tokenizer.calls) <= 10  # the window: the last release, and the bytes of one character


@pytest.mark.parametrize("num_tokens", [100, 1000])
def test_bytes_that_never_form_a_character_cost_bounded_work_per_token(num_tokens: int) -> None:
    """A lead byte of a three-byte character, again and again: each one a character that will never be
    complete. Held back only so long: released as replacement characters, as a full decode shows them."""
    tokenizer = ByteTokenizer()
    token_ids = [0xE4] * num_tokens + list(b" ok")
    deltas = _stream(tokenizer, token_ids)
    assert "".join(deltas) == tokenizer.decode(token_ids) == "\ufffd" * num_tokens + " ok"
    tokenizer.calls.pop()  # the check's own decode above
    assert max(tokenizer.calls) <= 40  # the same bound at 100 tokens and at 1000
    assert sum(tokenizer.calls) <= 40 * len(token_ids)


@pytest.mark.parametrize("num_tokens", [100, 1000])
def test_tokens_that_decode_to_nothing_cost_bounded_work_per_token(num_tokens: int) -> None:
    tokenizer = ByteTokenizer()
    token_ids = list(b"a") + [SPECIAL] * num_tokens + list("é b".encode())
    deltas = _stream(tokenizer, token_ids)
    assert "".join(deltas) == "aé b"
    assert max(tokenizer.calls) <= 40 and sum(tokenizer.calls) <= 40 * len(token_ids)


def test_a_character_after_a_long_run_of_special_tokens_stays_whole() -> None:
    """The run that decodes to nothing is let go without cutting the character that follows it."""
    tokenizer = ByteTokenizer()
    for num_special in range(5, 20):
        deltas = _stream(tokenizer, [*b"a", *[SPECIAL] * num_special, *"世界".encode(), *b"!"])
        assert "".join(deltas) == "a世界!" and all("\ufffd" not in delta for delta in deltas), num_special


def test_an_incomplete_character_at_the_end_is_flushed_as_it_decodes() -> None:
    tokenizer = ByteTokenizer()
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    assert [detokenizer.add(t) for t in "ab".encode() + "世".encode()[:2]] == ["a", "b", "", ""]
    assert detokenizer.flush() == "\ufffd"  # the request ended mid-character


def test_special_tokens_are_kept_when_asked() -> None:
    tokenizer = ByteTokenizer()
    detokenizer = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    assert "".join(detokenizer.add(t) for t in [*b"a", SPECIAL, *b"b"]) + detokenizer.flush() == "a<s>b"
