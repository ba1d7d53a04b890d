"""Sequence state and its token stop rules, and incremental detokenization, on the bundled tokenizer.

(Text, stop strings and streamed deltas are the output processor's: test_output_processor.py.)"""

from __future__ import annotations

import pytest

from llm_runtime import IncrementalDetokenizer, SamplingParams, Sequence, SequenceStatus

MULTIBYTE = "Hello 世界! Emoji: 🌍🚀 and café, naïve, 日本語のテキスト. 👩‍👩‍👧 done"


@pytest.fixture(scope="module")
def tokenizer(bundled_tokenizer):
    return bundled_tokenizer


def _sequence(tokenizer, params: SamplingParams, prompt: str = "Say something:") -> Sequence:
    prompt_ids = tokenizer.encode(prompt)
    return Sequence("r", prompt_ids, params, max_new_tokens=params.max_tokens or 100, eos_token_ids=(2,))


@pytest.mark.slow
def test_deltas_join_to_the_text_with_multibyte_characters(tokenizer) -> None:
    ids = tokenizer.encode(MULTIBYTE)
    assert len(ids) > len(MULTIBYTE.split())  # emoji and CJK span several tokens
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("Prompt:"))
    deltas = [detokenizer.add(token) for token in ids] + [detokenizer.flush()]
    assert "".join(deltas) == MULTIBYTE == tokenizer.decode(ids)
    assert all("\ufffd" not in delta for delta in deltas)  # never a half character
    assert "" in deltas  # some tokens only completed a character later


@pytest.mark.slow
def test_eos_length_and_min_tokens(tokenizer) -> None:
    seq = _sequence(tokenizer, SamplingParams(max_tokens=3))
    for token in tokenizer.encode(" one two three four")[:3]:
        seq.append_token(token, now=1.0)
    assert seq.status.finish_reason == "length" and seq.times.finished == 1.0
    with pytest.raises(RuntimeError, match="finished"):
        seq.append_token(5, now=2.0)
    eos = _sequence(tokenizer, SamplingParams(max_tokens=10, min_tokens=2))
    assert eos.blocked_token_ids() == (2,)
    eos.append_token(tokenizer.encode(" hi")[0], now=0.0)
    eos.append_token(tokenizer.encode(" there")[0], now=0.0)
    assert eos.blocked_token_ids() == ()
    eos.append_token(2, now=0.5)
    assert eos.status.finish_reason == "stop" and eos.stop_reason is None
    ignoring = _sequence(tokenizer, SamplingParams(max_tokens=10, ignore_eos=True))
    ignoring.append_token(2, now=0.0)
    assert not ignoring.is_finished


def test_status_names_match_vllm() -> None:
    assert SequenceStatus.FINISHED_STOPPED.finish_reason == "stop"
    assert SequenceStatus.FINISHED_LENGTH.finish_reason == "length"
    assert SequenceStatus.FINISHED_ABORTED.finish_reason == "abort"
    assert SequenceStatus.FINISHED_ERROR.finish_reason == "error"
    assert SequenceStatus.RUNNING.finish_reason is None and not SequenceStatus.WAITING.is_finished
