"""The n-gram proposer and `SpeculativeConfig`."""

from __future__ import annotations

import pytest

from llm_runtime.spec_decode import SpeculativeConfig, propose_ngram


def test_the_longest_suffix_found_earlier_proposes_what_followed_it() -> None:
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 2, 6, 7]
    # suffix (6, 7) occurs at 1 and 6: the first, at 1, was followed by 8, 9, 1
    assert propose_ngram(tokens, 3, max_n=4) == [8, 9, 1]
    assert propose_ngram(tokens + [2], 3, max_n=4) == [6, 7, 2]  # (6, 7, 2) occurs at 6 only: a longer match wins
    assert propose_ngram([1, 2, 3, 1, 2], 10, max_n=2) == [3, 1, 2]  # fewer than asked: all that follows


def test_no_match_or_too_short_proposes_nothing() -> None:
    assert propose_ngram([1, 2, 3, 4], 3, max_n=3) == []
    assert propose_ngram([1], 3, max_n=3) == []
    assert propose_ngram([], 3, max_n=3) == []
    assert propose_ngram([4, 2, 9, 2], 3, max_n=3, min_n=2) == []  # only a 1-gram repeats


def test_periodic_text_proposes_the_period_again() -> None:
    assert propose_ngram([3, 1, 1, 1, 1], 2, max_n=3) == [1]  # (1, 1, 1) first at 1: one token follows it
    assert propose_ngram([7, 8, 7, 8, 7, 8], 4, max_n=2) == [7, 8, 7, 8]


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="prompt_lookup_min <= prompt_lookup_max"):
        propose_ngram([1, 2], 2, max_n=1, min_n=2)
    with pytest.raises(ValueError, match="num_tokens"):
        propose_ngram([1, 2], 0, max_n=2)


def test_the_config_parses_vllms_dict() -> None:
    config = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4})
    assert config == SpeculativeConfig("ngram", 4, 4, 1)
    draft = SpeculativeConfig.parse({"method": "draft", "model": "self", "quantization": "gguf",
                                     "num_speculative_tokens": 3})
    assert draft.model == "self" and draft.prompt_lookup_max is None
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse(config) is config


@pytest.mark.parametrize("value, message", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 1, "prompt_lookup_min": 3}, "need integers"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "takes no model"),
    ({"method": "draft", "num_speculative_tokens": 2}, "needs \"model\""),
    ({"method": "draft", "model": "self", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "are for the ngram"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown speculative_config key"),
    ({"method": "ngram"}, "needs \"method\" and \"num_speculative_tokens\""),
])
def test_bad_configs_are_refused_by_name(value, message) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(value)
