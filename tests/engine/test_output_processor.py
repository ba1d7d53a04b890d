"""The output processor: text deltas, stop strings, stop-token text, output kinds, constant work per token."""

from __future__ import annotations

import pytest

from llm_runtime import SamplingParams, Sequence
from llm_runtime.engine.input_processor import EngineRequest
from llm_runtime.engine.output_processor import OutputProcessor
from llm_runtime.sampling import RequestOutputKind

MULTIBYTE = "Hello 世界! Emoji: 🌍🚀 and café, naïve, 日本語のテキスト. 👩‍👩‍👧 done"


@pytest.fixture(scope="module")
def tokenizer(bundled_tokenizer):
    return bundled_tokenizer


def drive(tokenizer, params: SamplingParams, tokens: list[int], prompt: str = "Say something:"):
    """Append `tokens` one step at a time, as the scheduler does, and collect every output."""
    prompt_ids = tokenizer.encode(prompt)
    budget = params.max_tokens or 1000
    seq = Sequence("r", prompt_ids, params, max_new_tokens=budget, eos_token_ids=(2,))
    processor = OutputProcessor(tokenizer)
    processor.add_request(EngineRequest("r", None, prompt_ids, params, budget, 0.0), [seq])
    outputs, stopped = [], []
    for token in tokens:
        seq.append_token(token, now=0.0)
        processed = processor.process(["r"], {}, now=0.0)
        outputs += processed.outputs
        stopped += processed.finished
        if seq.is_finished:
            break
    return seq, outputs, stopped


def test_stop_string_across_tokens_is_cut_and_streaming_holds_it_back(tokenizer) -> None:
    ids = tokenizer.encode("The answer is forty-two, obviously.")
    params = SamplingParams(stop=["y-tw"], max_tokens=50, output_kind=RequestOutputKind.DELTA)
    seq, outputs, stopped = drive(tokenizer, params, ids)
    assert seq.status.finish_reason == "stop" and seq.stop_reason == "y-tw" and stopped == [seq]
    deltas = [o.outputs[0].text for o in outputs]
    assert "".join(deltas) == "The answer is fort"
    assert all("y-tw" not in "".join(deltas[: i + 1]) for i in range(len(deltas)))  # never streamed, then cut
    _, kept, _ = drive(tokenizer, SamplingParams(stop=["y-tw"], include_stop_str_in_output=True, max_tokens=50), ids)
    assert kept[-1].outputs[0].text == "The answer is forty-tw" and kept[-1].finished


def test_stop_token_text_is_dropped_unless_asked_for(tokenizer) -> None:
    newline = tokenizer.encode("\n")[0]
    tokens = tokenizer.encode("1. Red") + [newline]
    for include, expected in [(False, "1. Red"), (True, "1. Red\n")]:
        params = SamplingParams(stop_token_ids=[newline], include_stop_str_in_output=include)
        seq, outputs, stopped = drive(tokenizer, params, tokens)
        assert seq.is_finished and seq.stop_reason == newline and stopped == []  # the scheduler frees these
        assert outputs[-1].outputs[0].text == expected
        assert "".join(o.outputs[0].text_delta for o in outputs) == expected


def test_eos_text_is_not_output(tokenizer) -> None:
    tokens = tokenizer.encode(" hi there") + [2]
    seq, outputs, _ = drive(tokenizer, SamplingParams(max_tokens=10), tokens)
    assert seq.status.finish_reason == "stop" and outputs[-1].outputs[0].text == " hi there"


def test_a_stop_string_in_the_last_allowed_token_still_wins(tokenizer) -> None:
    ids = tokenizer.encode("one two three")
    seq, outputs, _ = drive(tokenizer, SamplingParams(stop=["three"], max_tokens=len(ids)), ids)
    assert seq.status.finish_reason == "stop" and seq.stop_reason == "three"
    assert outputs[-1].outputs[0].text == "one two "


def test_output_kinds(tokenizer) -> None:
    ids = tokenizer.encode(MULTIBYTE)
    final = SamplingParams(max_tokens=len(ids), output_kind=RequestOutputKind.FINAL_ONLY)
    _, outputs, _ = drive(tokenizer, final, ids)
    assert len(outputs) == 1 and outputs[0].finished and outputs[0].outputs[0].text == MULTIBYTE
    assert outputs[0].outputs[0].token_ids == ids and len(outputs[0].metrics.token_times) == len(ids)
    cumulative = SamplingParams(max_tokens=len(ids), logprobs=0)
    _, outputs, _ = drive(tokenizer, cumulative, ids)
    assert len(outputs) == len(ids) and outputs[-1].outputs[0].text == MULTIBYTE
    assert [len(o.outputs[0].token_ids) for o in outputs] == list(range(1, len(ids) + 1))


def test_delta_outputs_carry_one_token_each_and_constant_work(tokenizer, monkeypatch) -> None:
    """One output per token, even when its text is still incomplete; each holds only the new token, and
    the detokenizer decodes a window of a few tokens, however long the completion grows."""
    ids = tokenizer.encode(MULTIBYTE * 12)
    calls: list[int] = []
    decode = tokenizer.decode
    monkeypatch.setattr(tokenizer, "decode", lambda token_ids, **kw: calls.append(len(token_ids)) or decode(
        token_ids, **kw))
    params = SamplingParams(max_tokens=len(ids), output_kind=RequestOutputKind.DELTA, stop=["never seen"])
    seq, outputs, _ = drive(tokenizer, params, ids)
    assert len(outputs) == len(ids) and all(len(o.outputs[0].token_ids) == 1 for o in outputs)
    assert any(o.outputs[0].text == "" for o in outputs)  # a token that ended mid-character
    assert "".join(o.outputs[0].text for o in outputs) == MULTIBYTE * 12
    assert max(calls) <= 16 and len(calls) <= 2 * len(ids) + 2
    assert all(len(o.outputs[0].text) <= len("never seen") + 20 for o in outputs)
