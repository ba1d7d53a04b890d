"""Sequence state and stop rules, and incremental detokenization, on the bundled tokenizer."""

from __future__ import annotations

import pytest

from llm_runtime import IncrementalDetokenizer, SamplingParams, Sequence, SequenceStatus

MULTIBYTE = "Hello 世界! Emoji: 🌍🚀 and café, naïve, 日本語のテキスト. 👩‍👩‍👧 done"


@pytest.fixture(scope="module")
def tokenizer(bundled):
    return bundled[1]


def _sequence(tokenizer, params: SamplingParams, prompt: str = "Say something:") -> Sequence:
    prompt_ids = tokenizer.encode(prompt)
    return Sequence("r", prompt_ids, params, max_new_tokens=params.max_tokens or 100, eos_token_ids=(2,),
                    detokenizer=IncrementalDetokenizer(tokenizer, prompt_ids))


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
def test_stop_string_across_tokens_is_cut_and_streaming_holds_it_back(tokenizer) -> None:
    text = "The answer is forty-two, obviously."
    ids = tokenizer.encode(text)
    seq = _sequence(tokenizer, SamplingParams(stop=["y-tw"], max_tokens=50))
    streamed = ""
    for token in ids:
        seq.append_token(token, now=0.0)
        streamed += seq.take_text_delta()
        if seq.is_finished:
            break
    assert seq.status is SequenceStatus.FINISHED_STOPPED and seq.stop_reason == "y-tw"
    assert seq.output_text == "The answer is fort" == streamed
    kept = _sequence(tokenizer, SamplingParams(stop=["y-tw"], include_stop_str_in_output=True, max_tokens=50))
    for token in ids:
        kept.append_token(token, now=0.0)
        if kept.is_finished:
            break
    assert kept.output_text == "The answer is forty-tw"


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
    assert eos.status.finish_reason == "stop" and eos.stop_reason is None and eos.output_text == " hi there"
    ignoring = _sequence(tokenizer, SamplingParams(max_tokens=10, ignore_eos=True))
    ignoring.append_token(2, now=0.0)
    assert not ignoring.is_finished


def test_status_names_match_vllm() -> None:
    assert SequenceStatus.FINISHED_STOPPED.finish_reason == "stop"
    assert SequenceStatus.FINISHED_LENGTH.finish_reason == "length"
    assert SequenceStatus.FINISHED_ABORTED.finish_reason == "abort"
    assert SequenceStatus.RUNNING.finish_reason is None and not SequenceStatus.WAITING.is_finished


@pytest.mark.slow
def test_stop_token_text_is_dropped_unless_asked_for(tokenizer) -> None:
    newline = tokenizer.encode("\n")[0]
    tokens = tokenizer.encode("1. Red") + [newline]
    for include, expected in [(False, "1. Red"), (True, "1. Red\n")]:
        seq = _sequence(tokenizer, SamplingParams(stop_token_ids=[newline], include_stop_str_in_output=include))
        for token in tokens:
            seq.append_token(token, now=0.0)
        assert seq.is_finished and seq.stop_reason == newline and seq.output_text == expected
        assert seq.take_text_delta() == expected
